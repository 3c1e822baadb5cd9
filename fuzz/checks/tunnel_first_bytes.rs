//! The judge of a tunnel's first plain bytes on arbitrary bytes: never panics, answers
//! "need more" for at most `MAX_PREFIX` bytes, and an answer, once given for a prefix, is the
//! answer for every longer one (so how reads split the bytes never changes the verdict); a
//! prefix that opens with `CONNECT ` (any case) is always a request to another proxy.
//!
//! Input: the tunnel's first bytes.

use leasegate::policy::chained::{judge, Chained, MAX_PREFIX};

pub fn check(data: &[u8]) {
    let data = &data[..data.len().min(4 * MAX_PREFIX)];
    let mut answered: Option<Chained> = None;
    for end in 0..=data.len() {
        let now = judge(&data[..end]);
        match answered {
            None if now == Chained::NeedMore => {
                assert!(end <= MAX_PREFIX, "need more after {end} bytes: {data:?}")
            }
            None => answered = Some(now),
            Some(before) => assert_eq!(now, before, "{end} bytes of {data:?}"),
        }
    }
    if data.len() >= 8 && data[..8].eq_ignore_ascii_case(b"connect ") {
        assert!(matches!(answered, Some(Chained::Proxy(_))), "{data:?}");
    }
}
