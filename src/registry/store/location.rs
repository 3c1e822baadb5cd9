//! Where a journal is: a file path or a NATS JetStream stream, as `--journal` names it.
//!
//! Invariant: a `--journal` value that starts with `nats://` or `tls://` is a stream (and must
//! parse as one: servers and a stream name, and optionally `user:password@` or `token@`);
//! anything else is a file path, unchanged. Credentials from the URL are never shown: not by
//! `Display` (logs, errors), not by `Debug`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// The default NATS client port.
const DEFAULT_PORT: u16 = 4222;

/// A journal's location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalLocation {
    File(PathBuf),
    Nats(NatsLocation),
}

/// `nats://[USER:PASSWORD@|TOKEN@]HOST:PORT[,HOST:PORT...]/STREAM` (or `tls://...`, which
/// requires TLS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsLocation {
    /// `host:port` of every seed server, in the order given.
    pub servers: Vec<String>,
    /// The JetStream stream's name.
    pub stream: String,
    /// `tls://`: connect with TLS only.
    pub tls: bool,
    /// Credentials given in the URL (percent-decoded).
    pub auth: Option<NatsAuth>,
}

/// Credentials in a NATS URL's user part.
#[derive(Clone, PartialEq, Eq)]
pub enum NatsAuth {
    /// `user:password@`.
    UserPassword { user: String, password: String },
    /// `token@`.
    Token(String),
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::UserPassword { user, .. } => write!(f, "UserPassword({user:?}, ***)"),
            NatsAuth::Token(_) => f.write_str("Token(***)"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocationError {
    #[error("{0}: expected nats://HOST:PORT[,HOST:PORT...]/STREAM")]
    Shape(String),
    #[error("{url}: server {server:?} is not HOST:PORT")]
    Server { url: String, server: String },
    #[error("{url}: stream name {stream:?} may hold only letters, digits, '-' and '_'")]
    Stream { url: String, stream: String },
    #[error("{url}: the credentials before '@' are empty or not percent-encoded UTF-8")]
    Credentials { url: String },
}

impl FromStr for JournalLocation {
    type Err = LocationError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.starts_with("nats://") || text.starts_with("tls://") {
            text.parse().map(JournalLocation::Nats)
        } else {
            Ok(JournalLocation::File(PathBuf::from(text)))
        }
    }
}

impl FromStr for NatsLocation {
    type Err = LocationError;

    fn from_str(full: &str) -> Result<Self, Self::Err> {
        let (tls, rest) = match (full.strip_prefix("nats://"), full.strip_prefix("tls://")) {
            (Some(rest), _) => (false, rest),
            (None, Some(rest)) => (true, rest),
            (None, None) => return Err(LocationError::Shape(full.to_owned())),
        };
        // What errors show: the URL without its credentials.
        let (auth, rest) = match rest.split_once('/').map(|(servers, _)| servers.rfind('@')) {
            Some(Some(at)) => (Some(&rest[..at]), &rest[at + 1..]),
            _ => (None, rest),
        };
        let scheme = if tls { "tls" } else { "nats" };
        let url = &format!("{scheme}://{rest}");
        let shape = || LocationError::Shape(url.to_owned());
        let auth = auth
            .map(|auth| {
                NatsAuth::parse(auth).ok_or_else(|| LocationError::Credentials {
                    url: url.to_owned(),
                })
            })
            .transpose()?;
        let (servers, stream) = rest.split_once('/').ok_or_else(shape)?;
        if servers.is_empty() {
            return Err(shape());
        }
        if !valid_name(stream) {
            return Err(LocationError::Stream {
                url: url.to_owned(),
                stream: stream.to_owned(),
            });
        }
        let servers = servers
            .split(',')
            .map(|server| {
                server_addr(server).ok_or_else(|| LocationError::Server {
                    url: url.to_owned(),
                    server: server.to_owned(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(NatsLocation {
            servers,
            stream: stream.to_owned(),
            tls,
            auth,
        })
    }
}

impl NatsAuth {
    /// `user:password` or `token`, each part percent-decoded (a `:` or `@` in a password is
    /// written `%3A`, `%40`).
    fn parse(text: &str) -> Option<NatsAuth> {
        let decode = |part: &str| {
            percent_encoding::percent_decode_str(part)
                .decode_utf8()
                .ok()
                .map(|s| s.into_owned())
                .filter(|s| !s.is_empty())
        };
        Some(match text.split_once(':') {
            Some((user, password)) => NatsAuth::UserPassword {
                user: decode(user)?,
                password: decode(password)?,
            },
            None => NatsAuth::Token(decode(text)?),
        })
    }
}

/// `host[:port]` → `host:port`; hosts are names, IPv4 or bracketed IPv6 literals.
fn server_addr(text: &str) -> Option<String> {
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && !port.contains(']') => {
            (host, port.parse::<u16>().ok().filter(|p| *p != 0)?)
        }
        _ => (text, DEFAULT_PORT),
    };
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let ok = !bare.is_empty()
        && bare
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
    ok.then(|| format!("{host}:{port}"))
}

/// A stream name JetStream accepts and that is safe in a subject and a file name.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

impl fmt::Display for NatsLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "tls" } else { "nats" };
        // The user is shown, never a password or token.
        let user = match &self.auth {
            None => String::new(),
            Some(NatsAuth::UserPassword { user, .. }) => format!("{user}@"),
            Some(NatsAuth::Token(_)) => "***@".to_owned(),
        };
        write!(
            f,
            "{scheme}://{user}{}/{}",
            self.servers.join(","),
            self.stream
        )
    }
}

impl fmt::Display for JournalLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalLocation::File(path) => write!(f, "{}", path.display()),
            JournalLocation::Nats(nats) => nats.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_paths_stay_paths() {
        assert_eq!(
            "journal.jsonl".parse::<JournalLocation>().unwrap(),
            JournalLocation::File("journal.jsonl".into())
        );
        assert_eq!(
            "./nats:/x".parse::<JournalLocation>().unwrap(),
            JournalLocation::File("./nats:/x".into())
        );
    }

    #[test]
    fn nats_urls_name_servers_and_a_stream() {
        let JournalLocation::Nats(nats) = "nats://127.0.0.1:4222,n2,[::1]:5000/LEASES"
            .parse::<JournalLocation>()
            .unwrap()
        else {
            panic!("not a stream")
        };
        assert_eq!(nats.servers, ["127.0.0.1:4222", "n2:4222", "[::1]:5000"]);
        assert_eq!(nats.stream, "LEASES");
        assert!(!nats.tls);
        assert_eq!(
            nats.to_string(),
            "nats://127.0.0.1:4222,n2:4222,[::1]:5000/LEASES"
        );
        assert!("tls://h:1/S".parse::<NatsLocation>().unwrap().tls);
    }

    #[test]
    fn credentials_in_the_url_are_read_and_never_shown() {
        let nats: NatsLocation = "nats://lg-replica:s3cr%3At%40x@h1:4222,h2/LEASES"
            .parse()
            .unwrap();
        assert_eq!(
            nats.auth,
            Some(NatsAuth::UserPassword {
                user: "lg-replica".into(),
                password: "s3cr:t@x".into()
            })
        );
        assert_eq!(nats.servers, ["h1:4222", "h2:4222"]);
        assert_eq!(nats.to_string(), "nats://lg-replica@h1:4222,h2:4222/LEASES");
        assert!(!format!("{nats:?}").contains("s3cr"));
        let nats: NatsLocation = "tls://t0ken@h/S".parse().unwrap();
        assert_eq!(nats.auth, Some(NatsAuth::Token("t0ken".into())));
        assert_eq!(nats.to_string(), "tls://***@h:4222/S");
        assert!(!format!("{nats:?}").contains("t0ken"));
        for bad in [
            "nats://@h/S",
            "nats://u:@h/S",
            "nats://:p@h/S",
            "nats://%ff@h/S",
        ] {
            let error = bad.parse::<NatsLocation>().unwrap_err().to_string();
            assert!(error.contains("credentials"), "{bad}: {error}");
        }
        let error = "nats://u:hunter2@h:x/S"
            .parse::<NatsLocation>()
            .unwrap_err();
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }

    #[test]
    fn malformed_nats_urls_are_errors() {
        for bad in [
            "nats://h:4222",
            "nats:///S",
            "nats://h:0/S",
            "nats://h:x/S",
            "nats://h/",
            "nats://h/a.b",
            "nats://h/a*",
            "nats://h,/S",
            "nats://a b/S",
        ] {
            assert!(
                bad.parse::<JournalLocation>().is_err(),
                "{bad} should not parse"
            );
        }
    }
}
