//! An MCP server's answer, with every tool list in it cut to the tools the lease may call:
//! a JSON body read whole, an event stream event by event.
//!
//! Invariant: pure and bounded — at most [`MAX_HELD`] bytes are held (a JSON body, or one
//! event); a message that is not a tool list passes byte for byte; a tool list goes out with
//! only the tools `allowed` keeps — an event the answer ends in without its blank line, which
//! a lenient client may still read, included — and one that cannot be read, or an answer over the bound, is
//! never passed unread: the filter says so ([`Unread`]) and the caller ends the answer.

use serde_json::Value;

/// The most bytes held to read one JSON answer or one event.
pub const MAX_HELD: usize = 4 << 20;

/// Why an answer could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unread(pub String);

/// How the answer is framed (by its `Content-Type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `application/json`: one message or a batch.
    Json,
    /// `text/event-stream`: a message in each event's data.
    Events,
}

impl Framing {
    /// The framing of an answer with this `Content-Type` (`None`: neither, nothing to read).
    pub fn of(content_type: Option<&str>) -> Option<Framing> {
        let essence = content_type?.split(';').next()?.trim().to_ascii_lowercase();
        match essence.as_str() {
            "application/json" => Some(Framing::Json),
            "text/event-stream" => Some(Framing::Events),
            _ => None,
        }
    }
}

/// One answer being filtered.
pub struct Filter<F> {
    framing: Framing,
    allowed: F,
    /// The JSON body so far, or the current event's lines.
    held: Vec<u8>,
    /// Events: the last byte was a CR (an LF right after it ends the same line).
    after_cr: bool,
    /// Events: where the current line starts in `held`.
    line_start: usize,
    /// Tools taken out of lists so far.
    pub hidden: u64,
    /// Tools left in lists so far.
    pub shown: u64,
}

impl<F: FnMut(&str) -> bool> Filter<F> {
    pub fn new(framing: Framing, allowed: F) -> Filter<F> {
        Filter {
            framing,
            allowed,
            held: Vec::new(),
            after_cr: false,
            line_start: 0,
            hidden: 0,
            shown: 0,
        }
    }

    /// The next bytes of the answer; what may go to the client now is appended to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Result<(), Unread> {
        match self.framing {
            Framing::Json => {
                if self.held.len() + bytes.len() > MAX_HELD {
                    return Err(Unread(format!(
                        "the answer to tools/list is over {MAX_HELD} bytes"
                    )));
                }
                self.held.extend_from_slice(bytes);
                Ok(())
            }
            Framing::Events => self.feed_events(bytes, out),
        }
    }

    /// The answer ended: the rest of it, filtered.
    pub fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), Unread> {
        match self.framing {
            Framing::Json => {
                let body = std::mem::take(&mut self.held);
                let mut value: Value = serde_json::from_slice(&body)
                    .map_err(|e| Unread(format!("the server's answer is not JSON: {e}")))?;
                match self.filter(&mut value) {
                    true => out.extend_from_slice(
                        &serde_json::to_vec(&value).expect("a Value serialises"),
                    ),
                    false => out.extend_from_slice(&body),
                }
                Ok(())
            }
            // An event not ended by a blank line is not dispatched by a client that follows
            // the standard; for one that dispatches it anyway, it is read as an event (its
            // last line too) and goes as it came, or filtered and still unended.
            Framing::Events if self.held.is_empty() => Ok(()),
            Framing::Events => self.read_event(out, false),
        }
    }

    fn feed_events(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Result<(), Unread> {
        for &b in bytes {
            if self.after_cr && b == b'\n' {
                self.after_cr = false;
                self.held.push(b);
                self.line_start = self.held.len();
                continue;
            }
            self.after_cr = b == b'\r';
            self.held.push(b);
            if b == b'\r' || b == b'\n' {
                let line = &self.held[self.line_start..self.held.len() - 1];
                if line.is_empty() {
                    self.read_event(out, true)?;
                } else {
                    self.line_start = self.held.len();
                }
            } else if self.held.len() > MAX_HELD {
                return Err(Unread(format!(
                    "an event of the server's stream is over {MAX_HELD} bytes"
                )));
            }
        }
        Ok(())
    }

    /// The held event ended (`ended`: its blank line is the last byte held; else the answer
    /// ended in it): it goes out, its data filtered if it is a tool list.
    fn read_event(&mut self, out: &mut Vec<u8>, ended: bool) -> Result<(), Unread> {
        let event = std::mem::take(&mut self.held);
        // If the blank line was a CR, a following LF still belongs to it.
        self.line_start = 0;
        let read: std::borrow::Cow<'_, [u8]> = match ended {
            true => std::borrow::Cow::Borrowed(&event),
            // Its last line read as a line, as a lenient client would at the end.
            false => std::borrow::Cow::Owned([&event[..], b"\n"].concat()),
        };
        let mut data: Vec<u8> = Vec::new();
        let mut has_data = false;
        let mut others: Vec<&[u8]> = Vec::new();
        for line in lines(&read) {
            let (name, value) = field(line);
            if name == b"data" {
                if has_data {
                    data.push(b'\n');
                }
                has_data = true;
                data.extend_from_slice(value);
            } else {
                // Not the `data` field to the standard (`data` without its colon, ` data:`),
                // but data to a lenient reader: one that may spell a list is not passed.
                let lenient = line.trim_ascii_start();
                if lenient.len() >= 4
                    && lenient[..4].eq_ignore_ascii_case(b"data")
                    && looks_like_a_list(line)
                {
                    return Err(Unread(
                        "an event line a lenient client may read as data names a tool list"
                            .to_owned(),
                    ));
                }
                others.push(line);
            }
        }
        let rewritten = match has_data {
            false => None,
            true => match serde_json::from_slice::<Value>(&data) {
                Ok(mut value) => self.filter(&mut value).then_some(value),
                // Not JSON: no message the client will read either (the SDK drops it).
                Err(_) if !looks_like_a_list(&data) => None,
                Err(e) => {
                    return Err(Unread(format!(
                        "an event that may list tools is not JSON: {e}"
                    )))
                }
            },
        };
        match rewritten {
            None => out.extend_from_slice(&event),
            Some(value) => {
                for line in others {
                    out.extend_from_slice(line);
                    out.push(b'\n');
                }
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&serde_json::to_vec(&value).expect("a Value serialises"));
                out.extend_from_slice(match ended {
                    true => b"\n\n",
                    false => b"\n",
                });
            }
        }
        Ok(())
    }

    /// Cuts every tool list in `value` (a message or a batch); whether anything changed.
    fn filter(&mut self, value: &mut Value) -> bool {
        match value {
            Value::Array(messages) => {
                let mut changed = false;
                for message in messages {
                    changed |= self.filter_one(message);
                }
                changed
            }
            message => self.filter_one(message),
        }
    }

    fn filter_one(&mut self, message: &mut Value) -> bool {
        let Some(Value::Array(tools)) = message.get_mut("result").and_then(|r| r.get_mut("tools"))
        else {
            return false;
        };
        let before = tools.len();
        let allowed = &mut self.allowed;
        tools.retain(|tool| {
            tool.get("name")
                .and_then(Value::as_str)
                .is_some_and(&mut *allowed)
        });
        self.hidden += (before - tools.len()) as u64;
        self.shown += tools.len() as u64;
        before != tools.len()
    }
}

/// Whether data that is not JSON could still be read as a tool list by a lenient parser
/// (Python's reads `NaN`): it names `tools`, or holds an escape that could spell it. Such
/// data is not passed unread.
fn looks_like_a_list(data: &[u8]) -> bool {
    memchr::memmem::find(data, b"tools").is_some() || memchr::memmem::find(data, b"\\u").is_some()
}

/// An event's lines, without their ends (CRLF, LF or CR), the blank last one left out.
fn lines(event: &[u8]) -> Vec<&[u8]> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < event.len() {
        match event[i] {
            b'\r' | b'\n' => {
                lines.push(&event[start..i]);
                if event[i] == b'\r' && event.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    lines.retain(|line| !line.is_empty());
    lines
}

/// A line's field name and value (one space after the colon dropped), as the standard reads it.
fn field(line: &[u8]) -> (&[u8], &[u8]) {
    match memchr::memchr(b':', line) {
        Some(at) => {
            let value = &line[at + 1..];
            (&line[..at], value.strip_prefix(b" ").unwrap_or(value))
        }
        None => (line, &[]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(name: &str) -> bool {
        name.starts_with("read")
    }

    fn run(framing: Framing, chunks: &[&[u8]]) -> Result<(String, u64), Unread> {
        let mut filter = Filter::new(framing, allowed);
        let mut out = Vec::new();
        for chunk in chunks {
            filter.feed(chunk, &mut out)?;
        }
        filter.finish(&mut out)?;
        Ok((String::from_utf8(out).unwrap(), filter.hidden))
    }

    const LIST: &str = r#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"read_note"},{"name":"delete_note"},{"title":"no name"}]}}"#;

    #[test]
    fn a_json_list_keeps_only_the_allowed_tools() {
        let (out, hidden) = run(
            Framing::Json,
            &[&LIST.as_bytes()[..10], &LIST.as_bytes()[10..]],
        )
        .unwrap();
        let value: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            value["result"]["tools"],
            serde_json::json!([{"name": "read_note"}])
        );
        assert_eq!(hidden, 2);
        // Anything else passes byte for byte.
        let other = br#"{"jsonrpc":"2.0","id":3,"result":{"content":[]}}"#;
        assert_eq!(run(Framing::Json, &[other]).unwrap().0.as_bytes(), other);
    }

    #[test]
    fn an_event_stream_is_filtered_event_by_event_whatever_its_line_ends() {
        let stream = format!(
            "event: message\r\nid: 1\r\ndata: {LIST}\r\n\r\n: comment\n\nevent: message\rdata: {{\"id\":3,\"result\":{{}}}}\r\r"
        );
        for cut in [1, 7, 40, stream.len() - 2] {
            let (a, b) = stream.as_bytes().split_at(cut);
            let (out, hidden) = run(Framing::Events, &[a, b]).unwrap();
            assert_eq!(hidden, 2, "{out}");
            let first = out.split("\n\n").next().unwrap();
            assert!(
                first.starts_with("event: message\nid: 1\ndata: {"),
                "{first}"
            );
            assert!(!out.contains("delete_note"), "{out}");
            assert!(
                out.ends_with(": comment\n\nevent: message\rdata: {\"id\":3,\"result\":{}}\r\r"),
                "{out:?}"
            );
        }
        // Data split over lines is one message.
        let split = "data: {\"id\":2,\"result\":\ndata: {\"tools\":[{\"name\":\"delete\"}]}}\n\n";
        let (out, hidden) = run(Framing::Events, &[split.as_bytes()]).unwrap();
        assert_eq!(
            (out.as_str(), hidden),
            ("data: {\"id\":2,\"result\":{\"tools\":[]}}\n\n", 1)
        );
    }

    #[test]
    fn what_cannot_be_read_is_never_passed_unread() {
        assert!(run(Framing::Json, &[b"{\"result\":{\"tools\":[NaN]}}"]).is_err());
        assert!(run(
            Framing::Events,
            &[b"data: {\"result\":{\"tools\":[NaN]}}\n\n"]
        )
        .is_err());
        let big = vec![b'a'; MAX_HELD + 1];
        assert!(run(Framing::Json, &[&big]).is_err());
        assert!(run(Framing::Events, &[b"data: ", &big]).is_err());
        assert!(run(
            Framing::Events,
            &[b"data: {\"result\":{\"t\\u006fols\":[NaN]}}\n\n"]
        )
        .is_err());
        // A line a lenient client may read as data, spelling a list, is not passed.
        for line in [
            "data [{\"result\":{\"tools\":[]}}]\n\n",
            " data: {\"tools\":[]}\n\n",
        ] {
            assert!(run(Framing::Events, &[line.as_bytes()]).is_err(), "{line}");
        }
        // Data that is no JSON and names no list passes (the client drops it too).
        assert_eq!(
            run(Framing::Events, &[b"data: hello\n\n"]).unwrap().0,
            "data: hello\n\n"
        );
    }

    #[test]
    fn an_event_the_answer_ends_in_is_read_too() {
        // Not ended by a blank line: a standard client drops it; a lenient one would read it,
        // so its list is cut all the same, and it stays unended.
        let tail = "data: {\"id\":2,\"result\":\ndata: {\"tools\":[{\"name\":\"delete\"},{\"name\":\"read\"}]}}";
        let (out, hidden) = run(Framing::Events, &[tail.as_bytes()]).unwrap();
        assert_eq!(
            out,
            "data: {\"id\":2,\"result\":{\"tools\":[{\"name\":\"read\"}]}}\n"
        );
        assert_eq!(hidden, 1);
        // Anything else the answer ends in goes as it came.
        assert_eq!(
            run(Framing::Events, &[b"data: hel"]).unwrap().0,
            "data: hel"
        );
    }

    #[test]
    fn the_framing_is_the_content_type() {
        assert_eq!(
            Framing::of(Some("application/json; charset=utf-8")),
            Some(Framing::Json)
        );
        assert_eq!(
            Framing::of(Some("Text/Event-Stream")),
            Some(Framing::Events)
        );
        assert_eq!(Framing::of(Some("text/plain")), None);
        assert_eq!(Framing::of(None), None);
    }
}
