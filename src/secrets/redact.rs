//! What the proxy writes of a request it read: its target and its refusal details with every
//! secret's value, canary and placeholder taken out, in any percent-encoding; and what an
//! origin's answer may show the agent of a secret (nothing).
//!
//! Invariant: no string these functions return holds a loaded value, a canary or anything
//! that starts like a placeholder (`lgp_`, any case), raw or percent-decoded up to
//! [`DECODINGS`] times; what they take out is named (`[redacted]`), never repeated.

use super::placeholder::PREFIX;
use super::store::SecretSet;
use percent_encoding::percent_decode;
use std::borrow::Cow;

/// How many rounds of percent-decoding a piece is looked through: an origin that decodes
/// twice sees what two rounds give; four leaves no practical encoding out.
pub const DECODINGS: usize = 4;

/// What stands where something was taken out.
pub const REDACTED: &str = "[redacted]";

impl SecretSet {
    /// `path?query` as the proxy's outputs show it: a path segment (or a query name) that
    /// holds a value, a canary or a placeholder, in any encoding, is [`REDACTED`] whole, and
    /// every query value is (names kept); a value across segments (it holds a `/`) takes the
    /// whole path.
    pub fn shown_target(&self, path: &str, query: Option<&str>) -> String {
        let shown = self.pieces(path, query);
        if !self.holds(shown.as_bytes(), false) {
            return shown;
        }
        let shown = self.pieces(REDACTED, query);
        match self.holds(shown.as_bytes(), false) {
            false => shown,
            true => REDACTED.to_owned(),
        }
    }

    fn pieces(&self, path: &str, query: Option<&str>) -> String {
        let mut out = String::with_capacity(path.len() + query.map_or(0, str::len) + 1);
        for (i, segment) in path.split('/').enumerate() {
            if i > 0 {
                out.push('/');
            }
            out.push_str(self.piece(segment, false));
        }
        let Some(query) = query else {
            return out;
        };
        out.push('?');
        for (i, pair) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match pair.split_once('=') {
                Some((name, _)) => {
                    out.push_str(self.piece(name, true));
                    out.push('=');
                    out.push_str(REDACTED);
                }
                // A bare item is all value.
                None if pair.is_empty() => {}
                None => out.push_str(REDACTED),
            }
        }
        out
    }

    /// `text` (a refusal's detail, a message) with every value, canary and placeholder in it
    /// replaced by [`REDACTED`]; when one is there only percent-encoded, the whole text is
    /// withheld, as it cannot be taken out piece by piece.
    pub fn scrubbed<'t>(&self, text: &'t str) -> Cow<'t, str> {
        if !self.holds(text.as_bytes(), false) {
            return Cow::Borrowed(text);
        }
        let mut out = self.replace_exact(text);
        out = replace_placeholders(&out);
        match self.holds(out.as_bytes(), false) {
            false => Cow::Owned(out),
            true => Cow::Owned(
                "[withheld: the detail held a secret's value, a canary or a placeholder]".into(),
            ),
        }
    }

    /// A field of an origin's answer as the agent may see it: `None` when it holds no value
    /// or canary (raw or percent-decoded up to [`DECODINGS`] times), else the field with each
    /// one [`REDACTED`], or `REDACTED` alone when one is there only encoded. An origin that
    /// echoes a secret it was given (a redirect's `Location` keeping a query key, a header
    /// echoed back) never hands it to the agent. Placeholders stay: they are the agent's own.
    pub fn answered_field(&self, field: &[u8]) -> Option<Vec<u8>> {
        if !self.holds_value(field) {
            return None;
        }
        let mut out = Vec::with_capacity(field.len());
        let mut rest = field;
        while let Some((start, end)) = self.find_span(rest) {
            out.extend_from_slice(&rest[..start]);
            out.extend_from_slice(REDACTED.as_bytes());
            rest = &rest[end..];
        }
        out.extend_from_slice(rest);
        match self.holds_value(&out) {
            false => Some(out),
            true => Some(REDACTED.as_bytes().to_vec()),
        }
    }

    /// [`SecretSet::holds`] for values and canaries only (not placeholders), never reading
    /// `+` as a space.
    fn holds_value(&self, bytes: &[u8]) -> bool {
        self.holds_any(bytes, false, false)
    }

    /// `piece` itself, or [`REDACTED`] when it holds what must not be shown.
    fn piece<'p>(&self, piece: &'p str, form: bool) -> &'p str {
        match self.holds(piece.as_bytes(), form) {
            true => REDACTED,
            false => piece,
        }
    }

    /// Whether `bytes`, raw or decoded up to [`DECODINGS`] times (`+` as a space first where
    /// `form`), holds a value, a canary or a placeholder's prefix.
    fn holds(&self, bytes: &[u8], form: bool) -> bool {
        self.holds_any(bytes, form, true)
    }

    /// [`SecretSet::holds`], placeholders looked for only where `placeholders`.
    fn holds_any(&self, bytes: &[u8], form: bool, placeholders: bool) -> bool {
        let mut current: Cow<'_, [u8]> = Cow::Borrowed(bytes);
        if form && current.contains(&b'+') {
            current = Cow::Owned(
                current
                    .iter()
                    .map(|&b| if b == b'+' { b' ' } else { b })
                    .collect(),
            );
        }
        for round in 0..=DECODINGS {
            if self.find_exact(&current).is_some() || (placeholders && has_prefix(&current)) {
                return true;
            }
            if round == DECODINGS || !current.contains(&b'%') {
                return false;
            }
            let decoded: Vec<u8> = percent_decode(&current).collect();
            if decoded == *current {
                return false;
            }
            current = Cow::Owned(decoded);
        }
        false
    }

    /// `text` with every exact value and canary replaced.
    fn replace_exact(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some((start, end)) = self.find_span(rest.as_bytes()) {
            // The patterns are whole strings, so the span is on character boundaries.
            out.push_str(&rest[..start]);
            out.push_str(REDACTED);
            rest = &rest[end..];
        }
        out.push_str(rest);
        out
    }
}

/// Whether `bytes` holds `lgp_` in any case.
fn has_prefix(bytes: &[u8]) -> bool {
    bytes
        .windows(PREFIX.len())
        .any(|w| w.eq_ignore_ascii_case(PREFIX.as_bytes()))
}

/// `text` with each run `lgp_` + word characters replaced.
fn replace_placeholders(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut kept = 0;
    while i + PREFIX.len() <= bytes.len() {
        if bytes[i..i + PREFIX.len()].eq_ignore_ascii_case(PREFIX.as_bytes()) {
            let mut end = i + PREFIX.len();
            while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
                end += 1;
            }
            out.push_str(&text[kept..i]);
            out.push_str(REDACTED);
            kept = end;
            i = end;
        } else {
            i += 1;
        }
    }
    out.push_str(&text[kept..]);
    out
}

#[cfg(test)]
mod tests {
    use crate::secrets::SecretSet;
    use std::sync::Arc;

    // A `/` in the value: a path can hold it across two segments.
    const VALUE: &str = "value-of/the-github-secret";
    const CANARY: &str = "canary-never-to-be-sent";

    fn set() -> Arc<SecretSet> {
        SecretSet::for_tests(
            &format!(
                "canaries = [\"{CANARY}\"]\n\n[[secret]]\nid = \"github\"\nhosts = [\"api.github.test\"]\nheader = \"Authorization\"\nenv = \"V\"\nagents = [\"coder\"]\nenv_name = \"GITHUB_TOKEN\"\n"
            ),
            VALUE,
        )
    }

    /// `s` with every byte percent-encoded.
    fn encoded(s: &str) -> String {
        s.bytes().map(|b| format!("%{b:02X}")).collect()
    }

    #[test]
    fn a_segment_or_name_holding_one_in_any_encoding_is_redacted_whole() {
        let set = set();
        let twice = encoded(&encoded(VALUE));
        let cases = [
            (format!("/a/x{VALUE}y/b"), None, "[redacted]".to_owned()),
            (
                format!("/a/{}/b", encoded(VALUE)),
                None,
                "/a/[redacted]/b".into(),
            ),
            (format!("/a/{twice}"), None, "/a/[redacted]".into()),
            (format!("/{}", encoded(CANARY)), None, "/[redacted]".into()),
            (
                "/gists/lgp_github_abc".into(),
                None,
                "/gists/[redacted]".into(),
            ),
            (
                "/gists/%4Cgp_github_abc".into(),
                None,
                "/gists/[redacted]".into(),
            ),
            ("/gists/LGP%5Fx".into(), None, "/gists/[redacted]".into()),
            (
                "/find".into(),
                Some(format!("{VALUE}=1&q=2&flag&&x=")),
                "/find?[redacted]=[redacted]&q=[redacted]&[redacted]&&x=[redacted]".into(),
            ),
            (
                "/find".into(),
                Some(format!("a+{}=1", encoded(CANARY))),
                "/find?[redacted]=[redacted]".into(),
            ),
            ("/plain/path".into(), None, "/plain/path".into()),
        ];
        for (path, query, shown) in cases {
            assert_eq!(set.shown_target(&path, query.as_deref()), shown, "{path}");
        }
    }

    #[test]
    fn an_answer_field_never_shows_a_value() {
        let set = set();
        assert_eq!(set.answered_field(b"https://api.test/next?page=2"), None);
        let placeholder = b"Bearer lgp_github_x";
        assert_eq!(set.answered_field(placeholder), None, "the agent's own");
        let raw = format!("https://other.test/?key={VALUE}&a=1");
        assert_eq!(
            set.answered_field(raw.as_bytes()).unwrap(),
            b"https://other.test/?key=[redacted]&a=1"
        );
        let once = format!("https://other.test/?key={}", encoded(VALUE));
        assert_eq!(set.answered_field(once.as_bytes()).unwrap(), b"[redacted]");
        let twice = format!("x={}", encoded(&encoded(VALUE)));
        assert_eq!(set.answered_field(twice.as_bytes()).unwrap(), b"[redacted]");
        let canary = format!("echo {CANARY}");
        assert_eq!(
            set.answered_field(canary.as_bytes()).unwrap(),
            b"echo [redacted]"
        );
    }

    #[test]
    fn a_detail_is_scrubbed_or_withheld() {
        let set = set();
        assert_eq!(set.scrubbed("nothing here"), "nothing here");
        assert_eq!(
            set.scrubbed(&format!(
                "Host {VALUE}.evil and lgp_github_x9 too, {CANARY}"
            )),
            "Host [redacted].evil and [redacted] too, [redacted]"
        );
        let detail = format!("GET /{}", encoded(VALUE));
        let withheld = set.scrubbed(&detail);
        assert!(withheld.starts_with("[withheld"), "{withheld}");
    }
}
