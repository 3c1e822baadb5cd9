//! One route rule of a secret: a method and a path glob, and whether a request matches it.
//!
//! Invariant: rules match a path [`normalise`](path::normalise)d as the origin resolves it (no dot segments, only
//! unreserved characters decoded), never the raw path. `*` matches exactly one non-empty
//! segment and `**`, only as the last segment, one or more; every other segment matches itself
//! byte for byte, normalised the same way.

use crate::policy::path;

/// `method = "GET"` (exact, upper case) or `"*"`, and a path glob such as `/repos/*/issues/**`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `None`: any method.
    method: Option<String>,
    /// The segments after the leading `/`, without a trailing `**`.
    segments: Vec<Segment>,
    /// The glob ends in `**`: one or more further segments of any content.
    rest: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `*`: one non-empty segment.
    One,
}

impl Route {
    /// Reads a rule; the error says in words what is wrong with the path glob.
    pub fn parse(method: &str, path: &str) -> Result<Route, String> {
        let method = match method {
            "*" => None,
            m if !m.is_empty() && m.bytes().all(|b| b.is_ascii_uppercase()) => Some(m.to_owned()),
            m => {
                return Err(format!(
                    "method {m:?}: an upper-case method such as GET, or *"
                ))
            }
        };
        let Some(body) = path.strip_prefix('/') else {
            return Err(format!("path {path:?}: a path glob starts with /"));
        };
        if path.contains(['?', '#']) {
            return Err(format!(
                "path {path:?}: a path glob matches the path only, without a query or fragment"
            ));
        }
        let parts: Vec<&str> = body.split('/').collect();
        let mut segments = Vec::with_capacity(parts.len());
        let mut rest = false;
        for (i, part) in parts.iter().enumerate() {
            match *part {
                "**" if i + 1 == parts.len() => rest = true,
                "**" => {
                    return Err(format!(
                        "path {path:?}: ** stands for the rest of the path, so only as the last segment"
                    ))
                }
                "*" => segments.push(Segment::One),
                p if p.contains('*') => {
                    return Err(format!(
                        "path {path:?}: a wildcard is a whole segment, * (one segment) or ** (the rest)"
                    ))
                }
                "" if i + 1 < parts.len() => {
                    return Err(format!(
                        "path {path:?}: an empty segment (//) never matches, as origins merge it"
                    ))
                }
                p => match path::segment(p) {
                    Ok(path::Segment::Plain(literal)) => segments.push(Segment::Literal(literal)),
                    Ok(path::Segment::Dot | path::Segment::DotDot) => {
                        return Err(format!("path {path:?}: a . or .. segment never matches"))
                    }
                    Err(why) => {
                        return Err(format!("path {path:?}: never matches, as {why}"))
                    }
                },
            }
        }
        Ok(Route {
            method,
            segments,
            rest,
        })
    }

    /// Whether a request with `method` and the [`normalise`](path::normalise)d path `normal` is one this rule
    /// admits.
    pub fn matches(&self, method: &str, normal: &str) -> bool {
        if self.method.as_deref().is_some_and(|m| m != method) {
            return false;
        }
        let Some(body) = normal.strip_prefix('/') else {
            return false;
        };
        let parts: Vec<&str> = body.split('/').collect();
        let fixed = self.segments.len();
        let lengths_fit = match self.rest {
            true => parts.len() > fixed,
            false => parts.len() == fixed,
        };
        lengths_fit
            && self
                .segments
                .iter()
                .zip(&parts)
                .all(|(segment, part)| match segment {
                    Segment::One => !part.is_empty(),
                    Segment::Literal(literal) => literal == part,
                })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::path::normalise;

    fn route(method: &str, path: &str) -> Route {
        Route::parse(method, path).unwrap()
    }

    /// Whether `r` admits `method` on the raw `path`, as the checks ask: on its normal form,
    /// and an ambiguous path never.
    fn admits(r: &Route, method: &str, path: &str) -> bool {
        normalise(path).is_ok_and(|normal| r.matches(method, &normal))
    }

    #[test]
    fn a_literal_path_matches_itself_only() {
        let r = route("GET", "/user");
        assert!(admits(&r, "GET", "/user"));
        assert!(!admits(&r, "GET", "/user/"));
        assert!(!admits(&r, "GET", "/users"));
        assert!(!admits(&r, "GET", "/User"));
        assert!(!admits(&r, "POST", "/user"));
        assert!(!admits(&r, "GET", "user"));
    }

    #[test]
    fn one_star_is_one_non_empty_segment() {
        let r = route("*", "/repos/*/issues");
        assert!(admits(&r, "GET", "/repos/a/issues"));
        assert!(admits(&r, "DELETE", "/repos/a/issues"));
        assert!(!admits(&r, "GET", "/repos//issues"));
        assert!(!admits(&r, "GET", "/repos/a/b/issues"));
        assert!(!admits(&r, "GET", "/repos/a/issues/1"));
    }

    #[test]
    fn double_star_is_one_or_more_segments_at_the_end() {
        let r = route("POST", "/repos/**");
        assert!(admits(&r, "POST", "/repos/a"));
        assert!(admits(&r, "POST", "/repos/a/b/c"));
        assert!(admits(&r, "POST", "/repos/"));
        assert!(!admits(&r, "POST", "/repos"));
        assert!(!admits(&r, "POST", "/repo/a"));
    }

    #[test]
    fn dot_segments_are_resolved_before_matching() {
        let r = route("GET", "/repos/**");
        assert!(!admits(&r, "GET", "/repos/../admin"));
        assert!(!admits(&r, "GET", "/repos/%2e%2e/admin"));
        assert!(!admits(&r, "GET", "/repos/a/../../admin"));
        assert!(admits(&r, "GET", "/repos/./a"));
        assert!(admits(&r, "GET", "/repos/%2E/a"));
        assert!(admits(&r, "GET", "/repos/a/../b"));
        assert!(admits(&r, "GET", "/repos/.hidden"));
    }

    #[test]
    fn path_tricks_match_no_rule() {
        let r = route("GET", "/repos/**");
        for trick in [
            "/repos/..;/admin",
            "/repos/..;x=1/admin",
            "/repos/%2e%2e;/admin",
            "/repos/..%3b/admin",
            "/repos/a%2F..%2F..%2Fadmin",
            "/repos/a%5C..%5C..%5Cadmin",
            "/repos/a\\..\\..\\admin",
            "/repos/%252e%252e/admin",
            "/repos/%c0%ae%c0%ae/admin",
            "/repos/a%00/../../admin",
        ] {
            assert!(!admits(&r, "GET", trick), "{trick}");
        }
    }

    #[test]
    fn literals_match_their_normal_form() {
        let r = route("GET", "/us%65r/%7Ea");
        assert!(admits(&r, "GET", "/user/~a"));
        assert!(admits(&r, "GET", "/%75ser/%7ea"));
        let r = route("GET", "/a%3fb");
        assert!(admits(&r, "GET", "/a%3Fb"));
        assert!(!admits(&r, "GET", "/a?b"));
    }

    #[test]
    fn malformed_globs_are_refused_in_words() {
        let cases = [
            (
                "get",
                "/a",
                "method \"get\": an upper-case method such as GET, or *",
            ),
            ("GET", "a", "path \"a\": a path glob starts with /"),
            (
                "GET",
                "/a/**/b",
                "path \"/a/**/b\": ** stands for the rest of the path, so only as the last segment",
            ),
            (
                "GET",
                "/a*",
                "path \"/a*\": a wildcard is a whole segment, * (one segment) or ** (the rest)",
            ),
            (
                "GET",
                "/a/../b",
                "path \"/a/../b\": a . or .. segment never matches",
            ),
            (
                "GET",
                "/a/..;/b",
                "path \"/a/..;/b\": never matches, as it has a dot segment with a parameter or trailing characters (such as ..;)",
            ),
            (
                "GET",
                "/a?x=1",
                "path \"/a?x=1\": a path glob matches the path only, without a query or fragment",
            ),
        ];
        for (method, path, why) in cases {
            assert_eq!(Route::parse(method, path), Err(why.to_owned()), "{path}");
        }
    }
}
