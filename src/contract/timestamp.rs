//! The contract's one timestamp form: UTC, milliseconds, `Z` (`2026-09-15T10:00:00.000Z`).
//!
//! Invariant: a [`Timestamp`] is whole milliseconds since the Unix epoch; it formats back to
//! exactly the form it was parsed from. Pure: the clock is read only by [`Timestamp::now`],
//! which pure code never calls (it takes `now` as an argument).

use std::fmt;
use time::format_description::FormatItem;
use time::macros::format_description;
use time::{OffsetDateTime, PrimitiveDateTime, UtcOffset};

const FORM: &[FormatItem<'static>] =
    format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");

/// An instant, in whole milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a timestamp of the form 2026-09-15T10:00:00.000Z")]
pub struct TimestampError(String);

impl Timestamp {
    /// The wall clock, truncated to milliseconds.
    pub fn now() -> Timestamp {
        Timestamp::from_offset(OffsetDateTime::now_utc())
    }

    pub fn from_millis(ms: i64) -> Timestamp {
        Timestamp(ms)
    }

    pub fn as_millis(self) -> i64 {
        self.0
    }

    /// Parses the contract form only (UTC, three fraction digits, `Z`).
    pub fn parse(text: &str) -> Result<Timestamp, TimestampError> {
        // Every journal line carries one or more of these, so read the fixed positions
        // directly; `time` still does the calendar arithmetic and range checks.
        let b = text.as_bytes();
        let separators_ok = b.len() == 24
            && [
                (4, b'-'),
                (7, b'-'),
                (10, b'T'),
                (13, b':'),
                (16, b':'),
                (19, b'.'),
                (23, b'Z'),
            ]
            .iter()
            .all(|&(i, c)| b[i] == c);
        let num = |range: std::ops::Range<usize>| -> Option<u32> {
            b.get(range)?.iter().try_fold(0u32, |acc, &d| {
                d.is_ascii_digit().then(|| acc * 10 + u32::from(d - b'0'))
            })
        };
        let parsed = separators_ok
            .then(|| {
                let month = time::Month::try_from(num(5..7)? as u8).ok()?;
                let date =
                    time::Date::from_calendar_date(num(0..4)? as i32, month, num(8..10)? as u8)
                        .ok()?;
                let clock = time::Time::from_hms_milli(
                    num(11..13)? as u8,
                    num(14..16)? as u8,
                    num(17..19)? as u8,
                    num(20..23)? as u16,
                )
                .ok()?;
                Some(Timestamp::from_offset(
                    PrimitiveDateTime::new(date, clock).assume_utc(),
                ))
            })
            .flatten();
        parsed.ok_or_else(|| TimestampError(text.to_owned()))
    }

    /// Parses the contract form or any RFC 3339 instant (for `--now` and other human input).
    pub fn parse_lenient(text: &str) -> Result<Timestamp, TimestampError> {
        Timestamp::parse(text).or_else(|_| {
            OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
                .map(Timestamp::from_offset)
                .map_err(|_| TimestampError(text.to_owned()))
        })
    }

    pub fn saturating_add_millis(self, ms: i64) -> Timestamp {
        Timestamp(self.0.saturating_add(ms))
    }

    fn from_offset(t: OffsetDateTime) -> Timestamp {
        Timestamp((t.unix_timestamp_nanos() / 1_000_000) as i64)
    }
}

impl Timestamp {
    /// The contract form's 24 bytes, for the years 0 to 9999 (every timestamp a clock of
    /// this era reads); `None` for the others, which `Display` spells as `time` does.
    /// The calendar arithmetic is `time`'s; the digits are written here, straight into the
    /// array: every egress line carries two timestamps, and a formatter per field cost more
    /// than the rest of the line.
    pub fn contract_form(self) -> Option<[u8; 24]> {
        let t = OffsetDateTime::from_unix_timestamp_nanos(self.0 as i128 * 1_000_000).ok()?;
        let (year, month, day) = t.to_calendar_date();
        let (hour, minute, second, milli) = t.to_hms_milli();
        let year = u16::try_from(year).ok().filter(|y| *y <= 9999)?;
        let mut out = *b"0000-00-00T00:00:00.000Z";
        let mut digits = |at: usize, width: usize, mut n: u16| {
            for i in (at..at + width).rev() {
                out[i] = b'0' + (n % 10) as u8;
                n /= 10;
            }
        };
        digits(0, 4, year);
        digits(5, 2, u8::from(month).into());
        digits(8, 2, day.into());
        digits(11, 2, hour.into());
        digits(14, 2, minute.into());
        digits(17, 2, second.into());
        digits(20, 3, milli);
        Some(out)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(form) = self.contract_form() {
            // Digits and separators only: always UTF-8.
            return f.write_str(std::str::from_utf8(&form).map_err(|_| fmt::Error)?);
        }
        let t = OffsetDateTime::from_unix_timestamp_nanos(self.0 as i128 * 1_000_000)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH)
            .to_offset(UtcOffset::UTC);
        // Other years (signed or wider): `time`'s own spelling.
        let text = t.format(FORM).map_err(|_| fmt::Error)?;
        f.write_str(&text)
    }
}

impl serde::Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written four-digit form is `time`'s, across the calendar (leap days, the
    /// year boundaries, the last millisecond of 9999) and outside it (signed years before 0;
    /// past 9999, which `time` cannot hold, the epoch as ever).
    #[test]
    fn formats_as_time_does() {
        let time_form = |ms: i64| {
            OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
                .unwrap_or(OffsetDateTime::UNIX_EPOCH)
                .format(FORM)
                .unwrap()
        };
        let year_0 = -62_167_219_200_000;
        let after_9999 = 253_402_300_800_000;
        let mut samples = vec![
            0,
            1,
            999,
            year_0,
            year_0 - 1,
            after_9999 - 1,
            after_9999,
            951_782_400_000,   // 2000-02-29
            4_107_542_399_999, // 2100-02-28T23:59:59.999
            1_789_466_400_123,
        ];
        // A spread of instants over the whole range, odd steps so every field varies.
        let mut ms = year_0 - 10_000_000_000;
        while ms < after_9999 + 10_000_000_000 {
            samples.push(ms);
            ms += 7_919_999_999_937;
        }
        for ms in samples {
            assert_eq!(
                Timestamp::from_millis(ms).to_string(),
                time_form(ms),
                "at {ms} ms"
            );
        }
    }

    #[test]
    fn round_trips_the_contract_form() {
        let t = Timestamp::parse("2026-09-15T10:00:00.123Z").unwrap();
        assert_eq!(t.as_millis(), 1_789_466_400_123);
        assert_eq!(t.to_string(), "2026-09-15T10:00:00.123Z");
    }

    #[test]
    fn refuses_other_forms_unless_lenient() {
        for bad in [
            "2026-02-30T10:00:00.000Z",
            "2026-09-15T24:00:00.000Z",
            "2026-09-15T10:00:00.00aZ",
            "2026-09-15T11:00:00+01:00",
            "2026-09-15T10:00:00Z",
            "2026-09-15 10:00:00.000Z",
        ] {
            assert!(Timestamp::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            Timestamp::parse_lenient("2026-09-15T11:00:00+01:00").unwrap(),
            Timestamp::parse("2026-09-15T10:00:00.000Z").unwrap()
        );
    }
}
