//! The admin API: health, readiness, the health panel's status, metrics, leases with their
//! counters, children and last requests, revocation, recent refusals and the rates of the last
//! minutes, and the live dashboard page at `/` that reads them.
//!
//! `GET /leases` answers a page at a time (at most `MAX_PAGE_LIMIT` leases, with a cursor to
//! the next page), so no answer grows with the number of leases; `GET /refusals` is bounded by
//! its ring, `GET /leases/{id}/requests` and `GET /rates` by theirs. What walks every lease (`GET /leases`, a `/metrics` render) runs a few at once on
//! threads of its own ([`walks`]), `/metrics` renders at most once a second ([`scrape`]), and
//! the API holds at most [`MAX_CONNECTIONS`] connections: beyond either limit the answer is 503
//! at once, so a flood of admin requests costs the journal follower and the proxy nothing.
//!
//! Invariant: nothing answers a request whose `Host` does not name the admin API, and nothing
//! changes state on a request that is not JSON from the admin API's own origin
//! ([`origin`]); with a token configured, nothing but `/healthz` and the page at `/` answers
//! without it (the page holds no data: every call it makes carries the token); every answer
//! but `/metrics` and `/` is JSON, errors included. A lease's own proxy token opens that
//! lease's view and placeholders and nothing else ([`caller`]). A credential (a `proxy_url`
//! carrying a lease id or token, a lease's placeholders: [`placeholders`]) is shown only to a
//! caller that presented the configured admin token, or that lease's own token: with neither
//! presented nobody is authenticated, so nobody gets one.

pub mod approvals;
pub mod caller;
pub mod ending;
pub mod issue;
pub mod origin;
pub mod placeholders;
pub mod query;
pub mod scrape;
pub mod status;
pub mod walks;

use caller::{Caller, NotAuthorized};
pub use origin::AdminHosts;

use crate::config::{Credentials, LeasePortCredentials};
use crate::contract::lease::{lease_id, WALL_CLOCK_BUDGET};
use crate::contract::{token, Event, Lease, Timestamp};
use crate::descriptors;
use crate::log_gate::{Flood, Say};
use crate::proxy::lease_ports::LeasePorts;
use crate::proxy::{full, Body, Proxy};
use crate::registry::listing::{self, Cursor, Filter, Order};
use crate::registry::revocation::RevocationError;
use crate::registry::{ClockHealth, InvalidReason, RevokeError, Snapshot, Status};
use crate::telemetry::egress::{EgressEvent, Kind, LoggedVerdict};
use crate::telemetry::metrics::{self, RegistryFigures};
use crate::telemetry::{lease_requests, rates, recent_refusals};
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use query::{limit_of, query_pairs};
use serde_json::Map;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use walks::Walks;

/// Leases one caller may issue a second (`--max-issue-rate`'s default).
pub const DEFAULT_ISSUE_RATE: std::num::NonZeroU32 = match std::num::NonZeroU32::new(50) {
    Some(n) => n,
    None => unreachable!(),
};

/// Admin connections held at once; one more is answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 128;

/// How long a client may take to send a request's head, the wait for a keep-alive
/// connection's next request included.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client may take to send a revocation's body.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the walks' heap and the logs of refusals are tidied.
const TIDY_EVERY: Duration = Duration::from_secs(1);

/// What a connection beyond [`MAX_CONNECTIONS`] is answered, whatever it asks.
const TOO_MANY_CONNECTIONS: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/json\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 72\r\n\
\r\n\
{\"error\":\"the admin API is busy: too many connections open; try again\"}\n";

/// What the admin API reads.
pub struct AdminState {
    pub proxy: Arc<Proxy>,
    pub ports: Option<Arc<LeasePorts>>,
    /// The shared proxy listener, for credential proxy URLs.
    pub proxy_addr: SocketAddr,
    /// Bearer token for every route but `/healthz`.
    pub token: Option<String>,
    /// The `Host` values requests may carry (DNS rebinding names another).
    pub hosts: AdminHosts,
    /// Set once the journal is loaded and every listener is bound; cleared by a drain.
    pub ready: AtomicBool,
    /// The lease-walking routes' limit and threads.
    pub walks: Walks,
    /// The last `/metrics` render.
    pub scrapes: scrape::Scrapes,
    /// Connections turned away at [`MAX_CONNECTIONS`] since start.
    pub refused_connections: AtomicU64,
    /// When the admin API was built: the status's uptime.
    pub started: Instant,
    /// `POST /leases`: the issuer's rules and its per-caller rate.
    pub authority: crate::issuer::Authority,
}

impl AdminState {
    /// The admin API of `proxy`, not ready yet.
    pub fn new(
        proxy: Arc<Proxy>,
        ports: Option<Arc<LeasePorts>>,
        proxy_addr: SocketAddr,
        token: Option<String>,
        hosts: AdminHosts,
    ) -> std::io::Result<AdminState> {
        Ok(AdminState {
            proxy,
            ports,
            proxy_addr,
            token,
            hosts,
            ready: AtomicBool::new(false),
            walks: Walks::new()?,
            scrapes: scrape::Scrapes::default(),
            refused_connections: AtomicU64::new(0),
            started: Instant::now(),
            authority: crate::issuer::Authority::new(
                crate::contract::narrow::RootPolicy::default(),
                crate::issuer::IssueRate::new(DEFAULT_ISSUE_RATE),
                crate::issuer::REFUSALS_RECORDED_PER_SECOND,
            ),
        })
    }

    /// Issues leases under `issuing` (the root policy and rate `serve` was given).
    pub fn issuing(mut self, issuing: crate::config::Issuing) -> AdminState {
        self.authority = crate::issuer::Authority::new(
            issuing.root,
            crate::issuer::IssueRate::new(issuing.rate),
            issuing.refusals_recorded,
        );
        self
    }
}

/// Serves the admin API until `shutdown`: at most [`MAX_CONNECTIONS`] connections at once.
pub async fn serve(listener: TcpListener, state: Arc<AdminState>, shutdown: CancellationToken) {
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut turned_away = Flood::default();
    let mut tidy = tokio::time::interval(TIDY_EVERY);
    tidy.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tidy.tick() => {
                state.walks.tidy();
                if let Some(s) = turned_away.end_if_quiet(Instant::now()) {
                    tracing::info!(turned_away = s.total, lasted = ?s.lasted, "admin API: connections are accepted again");
                }
                continue;
            }
            accepted = accept(&listener, &state) => match accepted {
                Some(stream) => stream,
                None => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            state.refused_connections.fetch_add(1, Ordering::Relaxed);
            match turned_away.occurred(1, Instant::now()) {
                Say::Start => {
                    tracing::warn!(
                        max = MAX_CONNECTIONS,
                        "admin API: every connection is taken; more are answered 503 and closed"
                    )
                }
                Say::Summary(s) => {
                    tracing::warn!(
                        turned_away = s.repeats,
                        since_first = s.total,
                        "admin API: connections are still turned away"
                    )
                }
                Say::Quiet => {}
            }
            turn_away(stream);
            descriptors::arm_spare();
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(route(state, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            // Its descriptor is free now: hold it as the spare if the spare was used.
            descriptors::arm_spare();
        });
    }
}

/// Answers a connection beyond the limit with a 503 and closes it, without a task: a fresh
/// socket's send buffer takes the few bytes at once (if not, it is closed unanswered).
fn turn_away(stream: TcpStream) {
    use std::io::Write;
    if let Ok(stream) = stream.into_std() {
        let _ = (&stream).write(TOO_MANY_CONNECTIONS);
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
}

/// The next admin connection. Out of descriptors, the spare one is given up to take it, so the
/// operator can still reach `/healthz`, `/readyz` and revocation; `None`: nothing accepted.
async fn accept(listener: &TcpListener, state: &AdminState) -> Option<tokio::net::TcpStream> {
    let error = match listener.accept().await {
        Ok((stream, _)) => return Some(stream),
        Err(error) => error,
    };
    state
        .proxy
        .descriptors
        .accept_failed(descriptors::Listener::Admin, &error);
    if !descriptors::is_exhausted(&error) || !descriptors::release_spare() {
        return None;
    }
    // The connection that failed waits in the backlog: it is taken at once.
    let retried = tokio::time::timeout(Duration::from_millis(50), listener.accept()).await;
    match retried {
        Ok(Ok((stream, _))) => Some(stream),
        _ => {
            descriptors::arm_spare();
            None
        }
    }
}

fn json_response(status: StatusCode, value: Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string() + "\n"));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

fn error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    json_response(status, json!({"error": message.into()}))
}

/// `GET /check?lease=ID&target=T`: the verdict the running proxy would give the lease for the
/// target (`HOST[:PORT]` or a URL, as `leasegate check` takes it), with this proxy's own
/// configuration and state, names resolved as it resolves them; nothing is dialled or written.
async fn check(state: &AdminState, query: Option<&str>) -> Response<Body> {
    let pairs = match query_pairs(query, &["lease", "target"]) {
        Ok(pairs) => pairs,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let value = |key: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    let (Some(lease), Some(target)) = (value("lease"), value("target")) else {
        return error(
            StatusCode::BAD_REQUEST,
            "give lease=ID and target=HOST[:PORT] or a URL",
        );
    };
    let lease = match crate::contract::lease::lease_id_any_case(lease) {
        Ok(lease) => lease,
        Err(not) => return error(StatusCode::BAD_REQUEST, not.to_string()),
    };
    let proxy = &state.proxy;
    let explained =
        crate::proxy::explain::explain(&proxy.registry, &proxy.config, &lease, target).await;
    let refusal = explained.refusal.as_ref();
    json_response(
        StatusCode::OK,
        json!({
            "lease_id": lease,
            "target": target,
            "verdict": if refusal.is_some() { "refuse" } else { "allow" },
            "code": refusal.map(|r| r.code.to_string()),
            "status": refusal.map(|r| r.code.status().as_u16()),
            "reason": explained.reason,
            "notes": explained.notes,
        }),
    )
}

async fn route(state: Arc<AdminState>, req: Request<Incoming>) -> Response<Body> {
    if let Err(refused) = state.hosts.check(req.uri(), req.headers()) {
        return error(refused.status, refused.message);
    }
    let mut path = req.uri().path().trim_end_matches('/').to_owned();
    // A lease's or an approval's id is taken in any case, as the contract writes it.
    for collection in ["/leases/", "/approvals/"] {
        if let Some(rest) = path.strip_prefix(collection) {
            let (start, len) = (collection.len(), rest.find('/').unwrap_or(rest.len()));
            path[start..start + len].make_ascii_lowercase();
        }
    }
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    let is_public = segments == ["healthz"] || segments.is_empty();
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let caller = match is_public {
        true => Ok(Caller::Anyone),
        false => Caller::of(
            authorization,
            state.token.as_deref(),
            &state.proxy.registry.snapshot(),
        )
        .and_then(|caller| {
            caller
                .may(req.method() == Method::GET, &segments)
                .map(|()| caller)
        }),
    };
    let caller = match caller {
        Ok(caller) => caller,
        Err(NotAuthorized::Unauthenticated(message)) => {
            let mut response = error(StatusCode::UNAUTHORIZED, message);
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return response;
        }
        Err(NotAuthorized::UnknownLease(id)) => {
            return error(StatusCode::NOT_FOUND, format!("no lease {id}"))
        }
        Err(NotAuthorized::NotItsLease) => {
            return error(
                StatusCode::FORBIDDEN,
                "a lease's proxy token reads only that lease: GET /leases/{id} and \
                 GET /leases/{id}/placeholders, POST /leases/{id}/complete and /stop, and \
                 POST /leases for its own children",
            )
        }
    };
    if let Err(refused) = origin::check_write(req.method(), req.headers()) {
        return error(refused.status, refused.message);
    }
    if let ["leases", id, ..] = segments.as_slice() {
        if let Err(not) = lease_id(id) {
            return error(StatusCode::BAD_REQUEST, not.to_string());
        }
    }
    let method = req.method().clone();
    match (&method, segments.as_slice()) {
        (&Method::GET, []) => dashboard(),
        (&Method::GET, ["healthz"]) => json_response(StatusCode::OK, json!({"status": "ok"})),
        (&Method::GET, ["readyz"]) => readyz(&state),
        (&Method::GET, ["status"]) => json_response(StatusCode::OK, status::status(&state)),
        (&Method::GET, ["rates"]) => match query::rates_leases(req.uri().query()) {
            Ok(leases) => rates(&state, &leases),
            Err(message) => error(StatusCode::BAD_REQUEST, message),
        },
        (&Method::GET, ["metrics"]) => match state.scrapes.fresh(Instant::now()) {
            Some(body) => metrics_answer(body),
            None => {
                let asked = Instant::now();
                walk(&state, move |state| {
                    metrics_answer(state.scrapes.answer(asked, || metrics(state)))
                })
                .await
            }
        },
        (&Method::GET, ["leases"]) => match LeasesQuery::parse(req.uri().query()) {
            Ok(query) => {
                let with_credentials = caller == Caller::Operator;
                walk(&state, move |state| leases(state, &query, with_credentials)).await
            }
            Err(message) => error(StatusCode::BAD_REQUEST, message),
        },
        (&Method::GET, ["leases", id]) => {
            match lease_view(
                &state,
                id,
                state.proxy.registry.now(),
                TOP_HOSTS,
                caller.sees_credentials_of(id),
            ) {
                Some(mut view) => {
                    add_open(&state, id, &mut view);
                    json_response(StatusCode::OK, view)
                }
                None => error(StatusCode::NOT_FOUND, format!("no lease {id}")),
            }
        }
        (&Method::GET, ["leases", id, "requests"]) => {
            let limit = query_pairs(req.uri().query(), &["limit"]).and_then(|pairs| {
                limit_of(&pairs, lease_requests::PER_LEASE, lease_requests::PER_LEASE)
            });
            match limit {
                Ok(limit) => lease_requests(&state, id, limit),
                Err(message) => error(StatusCode::BAD_REQUEST, message),
            }
        }
        (&Method::GET, ["leases", id, "placeholders"]) => {
            placeholders::placeholders(&state, id, caller.sees_credentials_of(id))
        }
        (&Method::POST, ["leases", id, "revoke"]) => {
            let id = id.to_string();
            revoke(&state, &id, req).await
        }
        (&Method::POST, ["leases"]) => issue::issue(&state, &caller, req).await,
        (&Method::POST, ["leases", id, "complete"]) => {
            let id = id.to_string();
            ending::end(&state, &id, Event::Completed, req).await
        }
        (&Method::POST, ["leases", id, "stop"]) => {
            let id = id.to_string();
            ending::end(&state, &id, Event::Stopped, req).await
        }
        (&Method::GET, ["check"]) => check(&state, req.uri().query()).await,
        (&Method::GET, ["approvals"]) => approvals::list(&state, req.uri().query()),
        (&Method::GET, ["approvals", id]) => approvals::one(&state, id),
        (&Method::POST, ["approvals", id]) => approvals::decide(&state, &caller, id, req).await,
        (&Method::GET, ["refusals"]) => {
            let limit = query_pairs(req.uri().query(), &["limit"])
                .and_then(|pairs| limit_of(&pairs, 50, recent_refusals::CAPACITY));
            match limit {
                Ok(limit) => refusals(&state, limit),
                Err(message) => error(StatusCode::BAD_REQUEST, message),
            }
        }
        (_, []) => error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on /"),
        ),
        (
            _,
            ["healthz" | "readyz" | "status" | "metrics" | "leases" | "refusals" | "rates" | "check"]
            | ["leases", _]
            | ["leases", _, "revoke" | "requests" | "placeholders" | "complete" | "stop"],
        ) => error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on {path}"),
        ),
        _ => error(StatusCode::NOT_FOUND, format!("no route {path}")),
    }
}

/// Leases per page of `GET /leases`: by default, and at most.
const PAGE_LIMIT: usize = 100;
const MAX_PAGE_LIMIT: usize = 1000;

/// The query of `GET /leases`.
#[derive(Debug, Default)]
struct LeasesQuery {
    filter: Filter,
    order: Order,
    cursor: Option<Cursor>,
    limit: usize,
    /// Also count every lease by status (one pass over all of them).
    counts: bool,
}

impl LeasesQuery {
    /// Parses `status`, `agent`, `parent`, `order`, `limit`, `cursor` and `counts`; anything
    /// else, or a value out of range, is refused with a message that says what is accepted.
    fn parse(query: Option<&str>) -> Result<LeasesQuery, String> {
        let pairs = query_pairs(
            query,
            &[
                "status", "agent", "parent", "order", "limit", "cursor", "counts",
            ],
        )?;
        let mut parsed = LeasesQuery {
            limit: limit_of(&pairs, PAGE_LIMIT, MAX_PAGE_LIMIT)?,
            ..LeasesQuery::default()
        };
        for (key, value) in &pairs {
            match key.as_str() {
                "status" => {
                    parsed.filter.status = Some(listing::parse_status(value).ok_or_else(|| {
                        let known: Vec<&str> = Status::ALL.iter().map(|s| s.as_str()).collect();
                        format!("status {value:?} is not one of {}", known.join(", "))
                    })?)
                }
                "agent" => parsed.filter.agent = Some(value.clone()),
                "parent" => match lease_id(value) {
                    Ok(id) => parsed.filter.parent = Some(id),
                    Err(not) => return Err(format!("parent {not}")),
                },
                "order" => {
                    parsed.order = Order::parse(value)
                        .ok_or_else(|| format!("order {value:?} is not oldest or newest"))?
                }
                "cursor" => parsed.cursor = Some(Cursor::decode(value).map_err(|e| e.to_string())?),
                "counts" => {
                    parsed.counts = match value.as_str() {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        _ => return Err(format!("counts {value:?} is not true or false")),
                    }
                }
                _ => {}
            }
        }
        Ok(parsed)
    }
}

/// What `/readyz` says of the clock, when there is something to say: the wall clock is behind
/// the latest time used (a step back; lifetime checks keep that time until it catches up), or
/// that time cannot be written down. Neither makes the proxy unready: it still never decides
/// with a time earlier than one it used, and a step back seen by every replica at once (a
/// clock source corrected) would otherwise take all of them out of service for its length.
fn clock_report(health: &ClockHealth) -> Option<Value> {
    if health.behind.is_zero() && health.not_kept.is_none() {
        return None;
    }
    let mut report = json!({
        "behind_seconds": health.behind.as_secs_f64(),
        "steps_back": health.steps_back,
    });
    if let Some(reason) = &health.not_kept {
        report["not_kept"] = reason.as_str().into();
    }
    Some(report)
}

/// One page of leases with their counters: `{"leases": [...], "next_cursor": ..., "total": N}`
/// (and `"counts"` by status when asked).
fn leases(state: &AdminState, query: &LeasesQuery, with_credentials: bool) -> Response<Body> {
    let now = state.proxy.registry.now();
    let snapshot = state.proxy.registry.snapshot();
    let ledger = &snapshot.ledger;
    let page = match listing::page(
        ledger,
        now,
        &query.filter,
        query.order,
        query.cursor.as_ref(),
        query.limit,
    ) {
        Ok(page) => page,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let views: Vec<Value> = page
        .leases
        .iter()
        .filter_map(|(l, _)| lease_view(state, &l.id, now, LIST_TOP_HOSTS, with_credentials))
        .collect();
    let mut answer = json!({
        "leases": views,
        "next_cursor": page.next.map(|c| c.encode()),
        "total": ledger.granted(),
        "limit": query.limit,
    });
    if query.counts {
        let counts: Map<String, Value> = listing::counts(ledger, now)
            .into_iter()
            .map(|(status, n)| (status.as_str().to_owned(), n.into()))
            .collect();
        answer["counts"] = counts.into();
    }
    json_response(StatusCode::OK, answer)
}

/// Hosts listed per lease in `GET /leases/{id}`.
const TOP_HOSTS: usize = 50;
/// Hosts listed per lease in `GET /leases` (the dashboard's "top hosts").
const LIST_TOP_HOSTS: usize = 5;
/// Open tunnels and streams `GET /leases/{id}` lists (the oldest; `open_total` counts all).
const OPEN_SHOWN: usize = 50;

/// The dashboard: one self-contained page (inline CSS and JS, no external fetches) that
/// polls `/leases`, `/refusals`, `/status` and `/rates` (a lease's page: `/leases/{id}`, its
/// requests and children) with the token it keeps in sessionStorage.
const DASHBOARD: &str = include_str!("admin/dashboard.html");

fn dashboard() -> Response<Body> {
    let mut response = Response::new(full(DASHBOARD));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // Inline script and style only, calls to this origin only; never framed (the page has a
    // revoke button).
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src data:; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    headers.insert(
        header::X_FRAME_OPTIONS,
        header::HeaderValue::from_static("DENY"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    response
}

/// `/readyz`: 200 when the journal is loaded, followed and writable and no drain has begun,
/// else 503 with the reason; both say how long ago the follower last read the journal.
fn readyz(state: &AdminState) -> Response<Body> {
    let registry = &state.proxy.registry;
    let problem = status::readiness(state);
    let lag = registry.follow_lag().map(|lag| lag.as_secs_f64());
    let (status, mut body) = match problem {
        None => (
            StatusCode::OK,
            json!({"ready": true, "journal_follow_lag_seconds": lag}),
        ),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"ready": false, "reason": reason, "journal_follow_lag_seconds": lag}),
        ),
    };
    // Reported, not a reason to stop serving: see `clock_report`.
    if let Some(clock) = clock_report(&registry.clock().health()) {
        body["clock"] = clock;
    }
    json_response(status, body)
}

/// Runs a handler that walks every lease (counts by status: ~60 ms at 100,000 leases) on the
/// walks' own threads ([`walks`]), or answers 503 at once when enough walks run already.
async fn walk(
    state: &Arc<AdminState>,
    handler: impl FnOnce(&AdminState) -> Response<Body> + Send + 'static,
) -> Response<Body> {
    let walking = state.clone();
    let failed = |why: String| error(StatusCode::INTERNAL_SERVER_ERROR, why);
    match state.walks.run(move || handler(&walking), failed).await {
        Ok(answer) => answer,
        Err(walks::Busy) => {
            let mut answer = error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the admin API is busy: {} requests that walk every lease (/leases, /metrics) \
                     are running; try again",
                    walks::AT_ONCE
                ),
            );
            answer
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            answer
        }
    }
}

/// A `/metrics` answer with its rendered body.
fn metrics_answer(body: bytes::Bytes) -> Response<Body> {
    let mut response = Response::new(full(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

/// Renders `/metrics` (and drops the series of leases closed longer than the grace).
fn metrics(state: &AdminState) -> String {
    let now = state.proxy.registry.now();
    let snapshot = state.proxy.registry.snapshot();
    let ledger = &snapshot.ledger;
    let telemetry = &state.proxy.telemetry;
    telemetry
        .metrics
        .prune(|id| ledger.check_chain(id, now).is_ok());
    let mut leases_by_status: Vec<(&'static str, u64)> = listing::counts(ledger, now)
        .into_iter()
        .map(|(status, n)| (status.as_str(), n))
        .collect();
    leases_by_status.sort();
    let stats = ledger.stats();
    let store = state.proxy.registry.store_health();
    let figures = RegistryFigures {
        leases_by_status,
        journal_lines: Event::ALL
            .iter()
            .map(|e| (e.as_str(), stats.events[*e as usize]))
            .collect(),
        journal_invalid_lines: InvalidReason::ALL
            .iter()
            .zip(stats.invalid_by_reason)
            .map(|(r, n)| (r.as_str(), n))
            .collect(),
        journal_append_failures: state.proxy.registry.append_failures(),
        revoke_broadcasts: state.proxy.registry.broadcasts(),
        journal_pending_revocations: state.proxy.registry.pending() as u64,
        store_lag_seconds: store.lag.as_secs_f64(),
        store_reconnects: store.reconnects,
        store_replaced: store.replaced,
        journal_follow_lag_seconds: state
            .proxy
            .registry
            .follow_lag()
            .map_or(0.0, |lag| lag.as_secs_f64()),
        admin_busy: vec![
            (
                "connections",
                state.refused_connections.load(Ordering::Relaxed),
            ),
            ("walks", state.walks.refused()),
        ],
        leases_issued: state.authority.outcomes(),
        capped_grants: stats.capped_grants,
        clock: state.proxy.registry.clock().health(),
        egress_dropped: telemetry.egress.dropped(),
        egress_stream: telemetry.stream.figures(),
        accept_errors: state.proxy.descriptors.accept_errors(),
        descriptor_refusals: state.proxy.descriptors.refused(),
        open_fds: descriptors::open_count(),
        max_fds: descriptors::Limit::current().map_or(state.proxy.descriptors.limit(), |l| l.soft),
        approvals_waiting: state.proxy.approvals.held_now() as u64,
        approval_lines_set_aside: state.proxy.approvals.set_aside(),
    };
    metrics::render(&telemetry.metrics, figures)
}

fn refusals(state: &AdminState, limit: usize) -> Response<Body> {
    let recent = state
        .proxy
        .telemetry
        .refusals
        .recent(limit.min(recent_refusals::CAPACITY));
    let recent: Vec<&EgressEvent> = recent.iter().map(|event| &**event).collect();
    json_response(StatusCode::OK, json!({ "refusals": recent }))
}

/// `GET /rates`: requests per second of the last [`rates::WINDOW`] whole seconds, oldest
/// first, in total and for each lease asked for.
fn rates(state: &AdminState, leases: &[String]) -> Response<Body> {
    let ids: Vec<&str> = leases.iter().map(String::as_str).collect();
    let history = state.proxy.telemetry.rates.history(&ids);
    let per_lease: Map<String, Value> = history
        .leases
        .into_iter()
        .map(|(id, counts)| (id, counts.into()))
        .collect();
    json_response(
        StatusCode::OK,
        json!({
            "interval_seconds": 1,
            "window_seconds": rates::WINDOW,
            "total": history.total,
            "leases": per_lease,
        }),
    )
}

/// `GET /leases/{id}/requests`: the lease's last exchanges, newest first.
fn lease_requests(state: &AdminState, id: &str, limit: usize) -> Response<Body> {
    let now = state.proxy.registry.now();
    if state
        .proxy
        .registry
        .snapshot()
        .ledger
        .status(id, now)
        .is_none()
    {
        return error(StatusCode::NOT_FOUND, format!("no lease {id}"));
    }
    let requests = state.proxy.telemetry.lease_requests.recent(id, limit);
    let requests: Vec<&EgressEvent> = requests.iter().map(|event| &**event).collect();
    json_response(
        StatusCode::OK,
        json!({"lease_id": id, "requests": requests, "limit": limit}),
    )
}

/// A request's body, at most `limit` bytes (413 beyond) within [`BODY_TIMEOUT`] (408).
pub(crate) async fn read_body(
    req: Request<Incoming>,
    limit: usize,
) -> Result<bytes::Bytes, Response<Body>> {
    let body = http_body_util::Limited::new(req.into_body(), limit).collect();
    match tokio::time::timeout(BODY_TIMEOUT, body).await {
        Ok(Ok(body)) => Ok(body.to_bytes()),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is larger than {limit} bytes"),
            ))
        }
        Ok(Err(e)) => Err(error(
            StatusCode::BAD_REQUEST,
            format!("unreadable body: {e}"),
        )),
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            format!("the body did not arrive within {BODY_TIMEOUT:?}"),
        )),
    }
}

/// The most a revocation's, a completion's or a stop's body holds.
pub(crate) const SMALL_BODY: usize = 16 * 1024;

async fn revoke(state: &AdminState, id: &str, req: Request<Incoming>) -> Response<Body> {
    let body = match read_body(req, SMALL_BODY).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    let reason = if body.is_empty() {
        None
    } else {
        match serde_json::from_slice::<Value>(&body) {
            Ok(value) => value
                .get("reason")
                .and_then(Value::as_str)
                .map(str::to_owned),
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("body is not JSON: {e}")),
        }
    };
    let Some(reason) = reason.filter(|r| !r.trim().is_empty()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "body must be {\"reason\": \"...\"}",
        );
    };
    match state.proxy.registry.revoke(id, &reason, Map::new()).await {
        Ok(revoked) => json_response(StatusCode::OK, json!({"lease_id": id, "revoked": revoked})),
        Err(RevokeError::Revocation(RevocationError::Unknown(_))) => {
            error(StatusCode::NOT_FOUND, format!("no lease {id}"))
        }
        // Revoked in memory; the record waits in the queue for the journal.
        Err(e) if e.revoked_in_memory() => json_response(
            StatusCode::ACCEPTED,
            json!({"lease_id": id, "revoked": true, "queued": true, "error": e.to_string()}),
        ),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// The lease's open tunnels and streams, the oldest [`OPEN_SHOWN`], with their bytes so far
/// (`"open"`), and how many are open (`"open_total"`).
fn add_open(state: &AdminState, id: &str, view: &mut Value) {
    let (open, total) = state.proxy.telemetry.metrics.open_of(id, OPEN_SHOWN);
    view["open"] = open
        .iter()
        .map(|o| {
            let (up, down) = o.moved();
            json!({
                "kind": match o.kind {
                    Kind::Connect => "connect",
                    Kind::Http => "forward",
                    Kind::Https => "https",
                },
                "host": o.host,
                "port": o.port,
                "started": o.started,
                "bytes_up": up,
                "bytes_down": down,
            })
        })
        .collect();
    view["open_total"] = total.into();
}

/// The proxy token of `lease`, minted with its key (`None` without the key).
fn minted(snapshot: &Snapshot, lease: &Lease) -> Option<String> {
    let key = snapshot.ledger.keyring()?.get(&lease.key_fingerprint)?;
    Some(token::mint(key, &lease.id))
}

/// One lease as the admin API shows it, with its counters (and its top hosts if `top` > 0).
/// `with_credentials`: the caller is authenticated, so `proxy_url` may carry the lease's
/// credential (its id, or its token in token mode); otherwise it carries none.
pub fn lease_view(
    state: &AdminState,
    id: &str,
    now: Timestamp,
    top: usize,
    with_credentials: bool,
) -> Option<Value> {
    let snapshot = state.proxy.registry.snapshot();
    let lease = snapshot.ledger.lease(id)?;
    let port = state.ports.as_ref().and_then(|p| p.port_of(id));
    let credentials = state.proxy.config.credentials;
    let credential = match credentials {
        _ if !with_credentials => None,
        Credentials::Id => Some(id.to_owned()),
        Credentials::Token => minted(&snapshot, lease),
    };
    let port_credentials = state.proxy.config.lease_port_credentials;
    // Every listener, lease ports included, speaks TLS with --tls-cert.
    let scheme = match state.proxy.tls {
        Some(_) => "https",
        None => "http",
    };
    let proxy_url = match (port, &state.ports, credential) {
        // A lease's own port needs no credential, unless --lease-port-credentials token.
        (Some(port), Some(ports), _) if port_credentials == LeasePortCredentials::None => {
            format!("{scheme}://{}", SocketAddr::new(ports.bind, port))
        }
        (Some(port), Some(ports), _) => {
            let addr = SocketAddr::new(ports.bind, port);
            match with_credentials.then(|| minted(&snapshot, lease)).flatten() {
                Some(token) => format!("{scheme}://agent:{token}@{addr}"),
                None => format!("{scheme}://{addr}"),
            }
        }
        (_, _, Some(credential)) => {
            format!("{scheme}://agent:{credential}@{}", state.proxy_addr)
        }
        (_, _, None) => format!("{scheme}://{}", state.proxy_addr),
    };
    let counters = state.proxy.telemetry.metrics.lease(id).unwrap_or_default();
    let count = |verdict: LoggedVerdict| -> u64 {
        counters
            .requests
            .iter()
            .filter(|((_, v, _), _)| *v == verdict)
            .map(|(_, n)| n)
            .sum()
    };
    let mut view = json!({
        "lease_id": lease.id,
        "parent_lease_id": lease.parent,
        "agent": lease.agent_name,
        "status": snapshot.ledger.status(id, now).map(|s| s.as_str()),
        "closed": snapshot.ledger.closed(id, now),
        "issued_at": lease.issued_at,
        "expires_at": lease.expires_at,
        "allow_hosts": lease.allow_hosts,
        "deny_hosts": lease.deny_hosts,
        "port": port,
        "proxy_url": proxy_url,
        "credentials": match credentials {
            Credentials::Id => "id",
            Credentials::Token => "token",
        },
        "lease_port_credentials": match port_credentials {
            LeasePortCredentials::None => "none",
            LeasePortCredentials::Token => "token",
        },
        "counters": {
            "requests": counters.total_requests(),
            "allowed": count(LoggedVerdict::Allow),
            "refused": count(LoggedVerdict::Refuse),
            "reported": count(LoggedVerdict::Report),
            "challenges": count(LoggedVerdict::Challenge),
            "bytes_up": counters.bytes_up,
            "bytes_down": counters.bytes_down,
            "open_tunnels": counters.open_tunnels,
            "open_connections": counters.open_connections,
        },
    });
    // The end shown is the effective one; say when the wall-clock budget set it.
    if lease.ends_by_wall_clock() {
        view["expires_by"] = WALL_CLOCK_BUDGET.into();
    }
    // Model budgets: the ceilings model calls spend, and what the lease and its subtree have
    // spent (every replica's calls, as this replica has folded them).
    let ceilings = crate::proxy::metering::ceilings(lease);
    let spent = state.proxy.telemetry.spending.of(id);
    if ceilings.any() || spent.subtree.calls > 0 {
        view["model"] = json!({
            "budget": {"tokens": ceilings.tokens, "cost_usd": ceilings.cost_usd, "steps": ceilings.steps},
            "spent": spent.own,
            "subtree_spent": spent.subtree,
            "in_flight": spent.in_flight,
        });
    }
    if top > 0 {
        view["top_hosts"] = counters
            .top_hosts(top)
            .into_iter()
            .map(|(host, c)| json!({"host": host, "requests": c.requests, "bytes_up": c.bytes_up, "bytes_down": c.bytes_down}))
            .collect();
        let routes = counters.top_routes(top);
        if !routes.is_empty() {
            view["top_routes"] = routes
                .into_iter()
                .map(|(route, c)| json!({"route": route, "requests": c.requests, "bytes_up": c.bytes_up, "bytes_down": c.bytes_down}))
                .collect();
        }
    }
    Some(view)
}
