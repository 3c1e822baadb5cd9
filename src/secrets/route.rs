//! One route rule of a secret: a method and a path glob, and whether a request matches it.
//!
//! Invariant: `*` matches exactly one non-empty path segment and `**`, only as the last
//! segment, one or more; every other segment matches itself byte for byte. A path with a `.`
//! or `..` segment (percent-encoded or not) matches no rule: what the origin would make of it
//! is not decided here.

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
                p if is_dot_segment(p) => {
                    return Err(format!("path {path:?}: a . or .. segment never matches"))
                }
                p => segments.push(Segment::Literal(p.to_owned())),
            }
        }
        Ok(Route {
            method,
            segments,
            rest,
        })
    }

    /// Whether a request with `method` and `path` (its path; a query, if left on, is ignored)
    /// is one this rule admits.
    pub fn matches(&self, method: &str, path: &str) -> bool {
        if self.method.as_deref().is_some_and(|m| m != method) {
            return false;
        }
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        let Some(body) = path.strip_prefix('/') else {
            return false;
        };
        let parts: Vec<&str> = body.split('/').collect();
        if parts.iter().any(|p| is_dot_segment(p)) {
            return false;
        }
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

/// `.` or `..`, also with the dots percent-encoded (`%2e`).
fn is_dot_segment(segment: &str) -> bool {
    let decoded = segment.replace("%2e", ".").replace("%2E", ".");
    decoded == "." || decoded == ".."
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(method: &str, path: &str) -> Route {
        Route::parse(method, path).unwrap()
    }

    #[test]
    fn a_literal_path_matches_itself_only() {
        let r = route("GET", "/user");
        assert!(r.matches("GET", "/user"));
        assert!(r.matches("GET", "/user?page=2"));
        assert!(!r.matches("GET", "/user/"));
        assert!(!r.matches("GET", "/users"));
        assert!(!r.matches("GET", "/User"));
        assert!(!r.matches("POST", "/user"));
        assert!(!r.matches("GET", "user"));
    }

    #[test]
    fn one_star_is_one_non_empty_segment() {
        let r = route("*", "/repos/*/issues");
        assert!(r.matches("GET", "/repos/a/issues"));
        assert!(r.matches("DELETE", "/repos/a/issues"));
        assert!(!r.matches("GET", "/repos//issues"));
        assert!(!r.matches("GET", "/repos/a/b/issues"));
        assert!(!r.matches("GET", "/repos/a/issues/1"));
    }

    #[test]
    fn double_star_is_one_or_more_segments_at_the_end() {
        let r = route("POST", "/repos/**");
        assert!(r.matches("POST", "/repos/a"));
        assert!(r.matches("POST", "/repos/a/b/c"));
        assert!(r.matches("POST", "/repos/"));
        assert!(!r.matches("POST", "/repos"));
        assert!(!r.matches("POST", "/repo/a"));
    }

    #[test]
    fn dot_segments_match_no_rule() {
        let r = route("GET", "/repos/**");
        assert!(!r.matches("GET", "/repos/../admin"));
        assert!(!r.matches("GET", "/repos/./a"));
        assert!(!r.matches("GET", "/repos/%2e%2e/admin"));
        assert!(!r.matches("GET", "/repos/%2E/a"));
        assert!(r.matches("GET", "/repos/.hidden"));
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
                "/a?x=1",
                "path \"/a?x=1\": a path glob matches the path only, without a query or fragment",
            ),
        ];
        for (method, path, why) in cases {
            assert_eq!(Route::parse(method, path), Err(why.to_owned()), "{path}");
        }
    }
}
