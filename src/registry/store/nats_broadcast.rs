//! The core NATS subjects replicas broadcast their closing records on, ahead of the journal
//! stream: `leasegate.revoke.<stream>.<lease_id>`. Core NATS delivers while the stream has no
//! leader (a failover, a step-down), so a refusal on one replica closes the lease on the others
//! within milliseconds; the stream record follows for durability.
//!
//! Invariant: transport only. Nothing heard here is trusted: every broadcast goes to
//! [`crate::registry::broadcast::check`] before it closes anything, and a broadcast lost (no
//! subscriber yet, a disconnection, a slow consumer) costs only time — the journal still
//! carries the record.

use super::Broadcast;
use crate::nats::{subject_token, NatsStream};
use futures_util::StreamExt;
use serde_json::Value;
use std::io;

/// Broadcast subjects: `leasegate.revoke.<stream>.<lease_id>` (outside every stream).
pub const BROADCAST_SUBJECTS: &str = "leasegate.revoke";

/// The broadcast subject of `lease_id`'s closings on `stream`.
pub fn subject(stream: &str, lease_id: Option<&str>) -> String {
    format!("{BROADCAST_SUBJECTS}.{stream}.{}", subject_token(lease_id))
}

/// The lease token of a broadcast subject on `stream`; `None` for any other subject.
pub fn lease_of<'a>(stream: &str, subject: &'a str) -> Option<&'a str> {
    let lease = subject
        .strip_prefix(BROADCAST_SUBJECTS)?
        .strip_prefix('.')?
        .strip_prefix(stream)?
        .strip_prefix('.')?;
    (!lease.is_empty() && !lease.contains('.')).then_some(lease)
}

/// Publishes our closing records and hears the other replicas' for one stream.
pub struct Broadcaster {
    client: async_nats::Client,
    stream: String,
    /// `None` once the client has closed: nothing more is heard.
    subscriber: tokio::sync::Mutex<Option<async_nats::Subscriber>>,
}

impl Broadcaster {
    /// Subscribes to every broadcast on `stream`'s subjects.
    pub async fn subscribe(stream: &NatsStream) -> io::Result<Broadcaster> {
        let name = stream.location.stream.clone();
        let subscriber = stream
            .client
            .subscribe(format!("{BROADCAST_SUBJECTS}.{name}.*"))
            .await
            .map_err(io::Error::other)?;
        Ok(Broadcaster {
            client: stream.client.clone(),
            stream: name,
            subscriber: tokio::sync::Mutex::new(Some(subscriber)),
        })
    }

    /// Publishes `record` on its lease's subject, without waiting (a task of the caller's
    /// runtime hands it to the connection).
    pub fn publish(&self, record: &Value) {
        let Ok(payload) = serde_json::to_vec(record) else {
            return;
        };
        let lease_id = record.get("lease_id").and_then(Value::as_str);
        let subject = subject(&self.stream, lease_id);
        let client = self.client.clone();
        tokio::spawn(async move {
            if let Err(error) = client.publish(subject, payload.into()).await {
                tracing::debug!(%error, "broadcasting a closing record; the journal carries it");
            }
        });
    }

    /// The next broadcast on one of our stream's subjects. Never resolves once the client has
    /// closed.
    pub async fn next(&self) -> Broadcast {
        let mut subscriber = self.subscriber.lock().await;
        loop {
            let next = match subscriber.as_mut() {
                Some(subscriber) => subscriber.next().await,
                None => std::future::pending().await,
            };
            let Some(message) = next else {
                *subscriber = None;
                continue;
            };
            if let Some(lease) = lease_of(&self.stream, message.subject.as_str()) {
                return Broadcast {
                    lease: lease.to_owned(),
                    payload: message.payload,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_name_the_stream_and_the_lease() {
        let lease = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
        let on = subject("LEASES", Some(lease));
        assert_eq!(on, format!("leasegate.revoke.LEASES.{lease}"));
        assert_eq!(lease_of("LEASES", &on), Some(lease));
        assert_eq!(lease_of("OTHER", &on), None);
        assert_eq!(lease_of("LEASE", &on), None);
        assert_eq!(lease_of("LEASES", "leasegate.revoke.LEASES."), None);
        assert_eq!(lease_of("LEASES", "leasegate.revoke.LEASES.a.b"), None);
        assert_eq!(
            lease_of("LEASES", &format!("leasegate.journal.{lease}")),
            None
        );
        assert_eq!(subject("LEASES", Some("a.b")), "leasegate.revoke.LEASES._");
    }
}
