//! Why and when a lease stopped opening anything, as every surface says it: the refusal's
//! detail and the egress line's `error` (the text of [`ChainError`]), the `leases` table's
//! CLOSED column, and the `closed` object of `leases --json`, `GET /leases` and
//! `GET /leases/{id}` ([`ClosedView`], built by [`ChainError::closed_view`] alone).
//!
//! Invariant: what it shows of a record's `by` and `reason` has no control, line-separating
//! or invisible formatting character and is at most [`FULL`] characters long (fewer in the
//! table), cut with an ellipsis: a signed record may still say anything, and what it says
//! must stay one line of bounded length wherever it is shown.

use super::ledger::{ChainError, Closure, Ledger, MAX_CHAIN_DEPTH};
use crate::contract::{Event, Timestamp};
use serde::Serialize;

/// How many characters of a record's `by` and `reason` are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub by: usize,
    pub reason: usize,
}

/// What a refusal, an egress line and the JSON views show.
pub const FULL: Bounds = Bounds {
    by: 64,
    reason: 240,
};

/// What the `leases` table shows (its last column; the whole record is in the journal).
pub const SHORT: Bounds = Bounds { by: 24, reason: 60 };

/// Why an ancestor opens nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Its earliest closing record, or its expiry (an `expired` closure without `by` or
    /// `reason`, at its `expires_at`).
    Closed(Closure),
    /// It is not valid yet.
    NotYetValid,
    /// It is not in the ledger.
    Unknown,
    /// It is more than [`MAX_CHAIN_DEPTH`] leases up the chain (or the chain is a cycle).
    TooDeep,
}

impl Ending {
    /// What an ancestor that is not closed is, as a `reason` (no record gives one).
    fn state(&self) -> Option<String> {
        match self {
            Ending::Closed(_) => None,
            Ending::NotYetValid => Some("not valid yet".into()),
            Ending::Unknown => Some("not known".into()),
            Ending::TooDeep => Some(format!(
                "more than {MAX_CHAIN_DEPTH} leases up the chain, or in a cycle"
            )),
        }
    }

    /// `was revoked at … by …: …`, or `is not known` (after the ancestor's id).
    pub fn said(&self, bounds: Bounds) -> String {
        match self {
            Ending::Closed(closure) => closure.said(bounds),
            other => format!("is {}", other.state().unwrap_or_default()),
        }
    }
}

impl Closure {
    /// `was revoked at 2026-12-02T07:01:02.000Z by issuer: the reason` (after a lease id);
    /// `by` and `reason` only when the record gives them, shown within `bounds`.
    pub fn said(&self, bounds: Bounds) -> String {
        let verb = match self.event {
            Event::Revoked => "was revoked",
            Event::Stopped => "was stopped",
            Event::Completed => "completed",
            Event::Expired => "expired",
            _ => "closed",
        };
        let mut text = format!("{verb} at {}", self.at);
        if let Some(by) = shown(self.by.as_deref(), bounds.by) {
            text.push_str(" by ");
            text.push_str(&by);
        }
        if let Some(reason) = shown(self.reason.as_deref(), bounds.reason) {
            text.push_str(": ");
            text.push_str(&reason);
        }
        text
    }
}

/// Whether `c` may not be shown as is: a control character (line breaks, escapes), a line or
/// paragraph separator, or an invisible formatting character that reorders or hides text
/// (bidirectional overrides and isolates, zero-width characters, the byte-order mark).
fn is_unshowable(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{2069}'
                | '\u{FEFF}'
        )
}

/// `text` as shown: every unshowable character a space, trimmed, at most `max` characters
/// (the last an ellipsis when it was cut); `None` when nothing is left.
pub fn shown(text: Option<&str>, max: usize) -> Option<String> {
    let clean: String = text?
        .chars()
        .map(|c| if is_unshowable(c) { ' ' } else { c })
        .collect();
    let clean = clean.trim();
    if clean.is_empty() || max == 0 {
        return None;
    }
    if clean.chars().count() <= max {
        return Some(clean.to_owned());
    }
    let mut cut: String = clean.chars().take(max - 1).collect();
    cut.truncate(cut.trim_end().len());
    cut.push('…');
    Some(cut)
}

/// The `closed` object: what closed a lease, when, by whom and why
/// (docs/reference/admin-api.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClosedView {
    /// `revoked`, `stopped`, `completed`, `expired` or `ancestor-closed`.
    pub event: &'static str,
    /// The closing record's `at`, or the expiry; `None` only for an ancestor that is not
    /// closed (not valid yet, not known, too far up).
    pub at: Option<Timestamp>,
    pub by: Option<String>,
    pub reason: Option<String>,
    /// The ancestor whose closing closes this lease (`ancestor-closed` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ancestor: Option<String>,
}

impl ClosedView {
    fn of(event: &'static str, closure: &Closure) -> ClosedView {
        ClosedView {
            event,
            at: Some(closure.at),
            by: shown(closure.by.as_deref(), FULL.by),
            reason: shown(closure.reason.as_deref(), FULL.reason),
            ancestor: None,
        }
    }
}

impl ChainError {
    /// The `closed` object of the lease this error is about; `None` for a lease that may
    /// still open (not valid yet) or is not known.
    pub fn closed_view(&self) -> Option<ClosedView> {
        match self {
            ChainError::Unknown(_) | ChainError::NotYetValid(_) => None,
            ChainError::Closed { closure, .. } => {
                Some(ClosedView::of(closure.event.as_str(), closure))
            }
            ChainError::AncestorClosed {
                ancestor, ending, ..
            } => {
                let view = match ending {
                    Ending::Closed(closure) => ClosedView::of("ancestor-closed", closure),
                    other => ClosedView {
                        event: "ancestor-closed",
                        at: None,
                        by: None,
                        reason: other.state(),
                        ancestor: None,
                    },
                };
                Some(ClosedView {
                    ancestor: Some(ancestor.clone()),
                    ..view
                })
            }
        }
    }

    /// The `leases` table's CLOSED cell (shortened); `None` as for [`ChainError::closed_view`].
    pub fn closed_cell(&self) -> Option<String> {
        match self {
            ChainError::Unknown(_) | ChainError::NotYetValid(_) => None,
            ChainError::Closed { closure, .. } => Some(closure.said(SHORT)),
            ChainError::AncestorClosed {
                ancestor, ending, ..
            } => Some(format!("ancestor {ancestor} {}", ending.said(SHORT))),
        }
    }
}

impl Ledger {
    /// The `closed` object of lease `id` at `now`: `None` while it opens, or may open later.
    pub fn closed(&self, id: &str, now: Timestamp) -> Option<ClosedView> {
        self.check_chain(id, now).err()?.closed_view()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revoked(by: Option<&str>, reason: Option<&str>) -> Closure {
        Closure {
            event: Event::Revoked,
            at: Timestamp::parse("2026-12-02T07:01:02.000Z").unwrap(),
            by: by.map(str::to_owned),
            reason: reason.map(str::to_owned),
        }
    }

    #[test]
    fn a_closing_says_its_event_time_by_and_reason() {
        let lease = "0f0f0f0f-0000-4000-8000-000000000001".to_owned();
        let closure = revoked(Some("issuer"), Some("revoked from the dashboard"));
        let error = ChainError::Closed {
            lease: lease.clone(),
            closure: closure.clone(),
        };
        assert_eq!(
            error.to_string(),
            "lease 0f0f0f0f-0000-4000-8000-000000000001 was revoked at 2026-12-02T07:01:02.000Z \
             by issuer: revoked from the dashboard"
        );
        let expired = Closure {
            event: Event::Expired,
            ..revoked(None, None)
        };
        assert_eq!(expired.said(FULL), "expired at 2026-12-02T07:01:02.000Z");
        let stopped = Closure {
            event: Event::Stopped,
            ..revoked(Some("agent"), None)
        };
        assert_eq!(
            stopped.said(FULL),
            "was stopped at 2026-12-02T07:01:02.000Z by agent"
        );
        let ancestor = ChainError::AncestorClosed {
            lease,
            ancestor: "1a1a1a1a-0000-4000-8000-000000000002".into(),
            ending: Ending::Closed(closure),
        };
        assert_eq!(
            ancestor.to_string(),
            "lease 0f0f0f0f-0000-4000-8000-000000000001 is closed: ancestor \
             1a1a1a1a-0000-4000-8000-000000000002 was revoked at 2026-12-02T07:01:02.000Z by \
             issuer: revoked from the dashboard"
        );
    }

    #[test]
    fn what_a_record_says_is_one_line_and_bounded() {
        assert_eq!(
            shown(Some("  a\r\nb\u{1b}[31m\u{202E}c\u{2028}d\t "), 100).as_deref(),
            Some("a  b [31m c d")
        );
        assert_eq!(shown(Some("\n\u{200B}"), 10), None);
        assert_eq!(shown(None, 10), None);
        assert_eq!(shown(Some("abc"), 3).as_deref(), Some("abc"));
        assert_eq!(shown(Some("abcd"), 3).as_deref(), Some("ab…"));
        // Characters, not bytes: a cut never splits one.
        assert_eq!(shown(Some("éééé"), 3).as_deref(), Some("éé…"));
        let long = "x".repeat(10_000);
        let error = ChainError::Closed {
            lease: "l".into(),
            closure: revoked(Some(&long), Some(&format!("first\nline {long}"))),
        };
        // "first line " is 11 characters; the ellipsis is the last one.
        let said = |bounds: Bounds| {
            format!(
                "was revoked at 2026-12-02T07:01:02.000Z by {}…: first line {}…",
                "x".repeat(bounds.by - 1),
                "x".repeat(bounds.reason - 12)
            )
        };
        let text = error.to_string();
        assert!(!text.chars().any(char::is_control), "{text}");
        assert_eq!(text, format!("lease l {}", said(FULL)));
        let view = error.closed_view().unwrap();
        assert_eq!(view.by.unwrap().chars().count(), FULL.by);
        assert_eq!(view.reason.unwrap().chars().count(), FULL.reason);
        assert_eq!(error.closed_cell().unwrap(), said(SHORT));
    }

    proptest::proptest! {
        /// Whatever a record says, what is shown is one line of at most `max` characters with
        /// nothing unshowable in it, and is what was said when that already was.
        #[test]
        fn anything_said_is_shown_within_its_bounds(text in "\\PC*|[\\x00-\\x1f\u{2028}\u{202e} a]*", max in 1usize..80) {
            if let Some(out) = shown(Some(&text), max) {
                proptest::prop_assert!(out.chars().count() <= max, "{out:?}");
                proptest::prop_assert!(!out.chars().any(is_unshowable), "{out:?}");
                proptest::prop_assert_eq!(out.trim(), out.as_str());
                if text.chars().count() <= max && !text.chars().any(is_unshowable) {
                    proptest::prop_assert_eq!(out.as_str(), text.trim());
                }
            }
        }
    }

    #[test]
    fn the_closed_object_names_the_ancestor_and_its_closing() {
        let closed = ChainError::AncestorClosed {
            lease: "c".into(),
            ancestor: "p".into(),
            ending: Ending::Closed(revoked(Some("issuer"), Some("done"))),
        };
        assert_eq!(
            serde_json::to_value(closed.closed_view()).unwrap(),
            serde_json::json!({"event": "ancestor-closed", "at": "2026-12-02T07:01:02.000Z",
                "by": "issuer", "reason": "done", "ancestor": "p"})
        );
        let waiting = ChainError::AncestorClosed {
            lease: "c".into(),
            ancestor: "p".into(),
            ending: Ending::NotYetValid,
        };
        assert_eq!(
            waiting.to_string(),
            "lease c is closed: ancestor p is not valid yet"
        );
        assert_eq!(
            serde_json::to_value(waiting.closed_view()).unwrap(),
            serde_json::json!({"event": "ancestor-closed", "at": null, "by": null,
                "reason": "not valid yet", "ancestor": "p"})
        );
        let own = ChainError::Closed {
            lease: "c".into(),
            closure: Closure {
                event: Event::Expired,
                ..revoked(None, None)
            },
        };
        assert_eq!(
            serde_json::to_value(own.closed_view()).unwrap(),
            serde_json::json!({"event": "expired", "at": "2026-12-02T07:01:02.000Z",
                "by": null, "reason": null})
        );
        assert_eq!(ChainError::NotYetValid("c".into()).closed_view(), None);
    }
}
