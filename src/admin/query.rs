//! The query strings of the admin API's GET routes: pairs of known keys given once, a `limit`
//! within its range, the lease ids of `GET /rates`.
//!
//! Invariant: what a parser here accepts is within its bounds (a known key, a limit from 1 to
//! its maximum, at most [`MAX_RATE_LEASES`] lease ids that are lower-case UUIDs); anything
//! else is an `Err` with the message the 400 answer carries, never a panic.

use crate::contract::lease::{is_lease_id, NotALeaseId};

/// The pairs of a query string, each key one of `known` and given once.
pub fn query_pairs(query: Option<&str>, known: &[&str]) -> Result<Vec<(String, String)>, String> {
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    for (i, (key, _)) in pairs.iter().enumerate() {
        if !known.contains(&key.as_str()) {
            return Err(format!(
                "unknown parameter {key:?} (known: {})",
                known.join(", ")
            ));
        }
        if pairs[..i].iter().any(|(k, _)| k == key) {
            return Err(format!("parameter {key:?} is given twice"));
        }
    }
    Ok(pairs)
}

/// The `limit` of a query: `default` when absent, at most `max`.
pub fn limit_of(pairs: &[(String, String)], default: usize, max: usize) -> Result<usize, String> {
    match pairs.iter().find(|(k, _)| k == "limit") {
        None => Ok(default),
        Some((_, value)) => match value.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(format!(
                "limit must be a number from 1 to {max}, not {value:?}"
            )),
        },
    }
}

/// Leases `GET /rates` answers for at once (a page of the dashboard).
pub const MAX_RATE_LEASES: usize = 100;

/// The leases of `GET /rates?leases=<id>,<id>`: none without the parameter.
pub fn rates_leases(query: Option<&str>) -> Result<Vec<String>, String> {
    let pairs = query_pairs(query, &["leases"])?;
    let Some((_, list)) = pairs.first() else {
        return Ok(Vec::new());
    };
    let ids = || list.split(',').filter(|id| !id.is_empty());
    let count = ids().count();
    if count > MAX_RATE_LEASES {
        return Err(format!(
            "leases names {count} leases; at most {MAX_RATE_LEASES} at once"
        ));
    }
    match ids().find(|id| !is_lease_id(id)) {
        Some(bad) => Err(format!(
            "leases: {}",
            NotALeaseId(bad.chars().take(64).collect())
        )),
        None => Ok(ids().map(str::to_owned).collect()),
    }
}
