//! Requests to MCP servers (`--mcp-server`), plain or inside terminated tunnels: a POST is read
//! whole and judged message by message before anything of it reaches the server — a
//! `tools/call` whose tool the lease's chain does not allow is refused, and answered as a
//! JSON-RPC error its SDK raises; one that a lease's `approvals` names waits for a human
//! ([`crate::approvals`]); the calls that go are steps, reserved along the chain — and
//! answers that may list tools (to a `tools/list`, or on a GET stream) are cut to the tools the
//! chain may call.
//!
//! Invariant: a request to an MCP server goes out only after its body was read and every
//! `tools/call` in it judged; a body that cannot be read one way is refused, never passed; a
//! tool list that cannot be read is never passed unread (the answer ends with a JSON-RPC
//! error); every call that went out is charged one step, on every path.

use super::metering;
use super::{Body, BoxError};
use crate::approvals::{Approvals, Call};
use crate::budget::{Bound, Charge, Reservation, Spending};
use crate::contract::Lease;
use crate::mcp::filter::{Filter, Framing};
use crate::mcp::message::{self, Messages, TOOLS_CALL};
use crate::mcp::{self as judged, McpServer, ToolVerdict};
use crate::policy::codes::{Code, Refusal};
use crate::telemetry::egress::{McpCall, McpMessage};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Value};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio_util::sync::CancellationToken;

/// The largest POST body read to judge it; larger ones are `body-too-large`.
pub const MAX_REQUEST: usize = 4 << 20;

/// The JSON-RPC error code of every answer the edge makes in a server's place (the range
/// JSON-RPC leaves to implementations).
pub const REFUSED: i64 = -32001;

/// One request to an MCP server, as read: what its egress line says, the ids an answer made in
/// the server's place answers, and the steps it holds.
#[derive(Debug)]
pub struct McpTap {
    line: McpCall,
    ids: Vec<Value>,
    batch: bool,
    steps: Option<Reservation>,
    hidden: Arc<AtomicU64>,
}

impl McpTap {
    /// A request whose body is not read (a GET stream, a DELETE).
    pub fn unread(server: &McpServer) -> McpTap {
        McpTap {
            line: McpCall {
                server: server.name.clone(),
                messages: Vec::new(),
                steps: 0,
                tools_hidden: None,
            },
            ids: Vec::new(),
            batch: false,
            steps: None,
            hidden: Arc::default(),
        }
    }

    /// Whether answers made in the server's place are JSON-RPC (a POST that was read).
    pub fn answers_as_json_rpc(&self) -> bool {
        !self.ids.is_empty()
    }

    /// The JSON-RPC answer to the request for `refusal`: an error for each of its requests
    /// (a batch's answer is a batch).
    pub fn refusal_body(&self, refusal: &Refusal, lease_id: Option<&str>) -> Vec<u8> {
        let error = |id: &Value| {
            json!({"jsonrpc": "2.0", "id": id, "error": {
                "code": REFUSED,
                "message": format!("leasegate refused this for lease {}: {} ({})",
                    lease_id.unwrap_or("(none)"), refusal.code, refusal.detail),
                "data": {"refusal": refusal.code.as_str(), "lease_id": lease_id},
            }})
        };
        let answer = match self.batch {
            true => Value::Array(self.ids.iter().map(error).collect()),
            false => error(&self.ids[0]),
        };
        serde_json::to_vec(&answer).expect("a Value serialises")
    }

    /// The request never reached the server: its steps are not charged.
    pub fn release(&mut self) {
        if let Some(steps) = self.steps.take() {
            steps.release();
        }
        self.line.steps = 0;
    }

    /// The exchange ended: the steps it reserved are charged (they went out), and its line's
    /// `mcp` object returned.
    pub fn finish(mut self) -> McpCall {
        if let Some(steps) = self.steps.take() {
            steps.settle(Charge::tool_calls(self.line.steps));
        }
        let hidden = self.hidden.load(Ordering::Relaxed);
        self.line.tools_hidden = (hidden > 0).then_some(hidden);
        self.line
    }

    /// Where a filter of the answer counts the tools it took out.
    pub fn hidden(&self) -> Arc<AtomicU64> {
        self.hidden.clone()
    }
}

/// Reads and judges a POST body to `server` under `chain` (the lease first): the tap (the
/// request's line and answer ids, whatever the outcome), and whether it may go — its tool
/// calls' steps reserved — or the refusal. `None` in place of the verdict: every tools/call
/// may go.
pub async fn judge(
    server: &McpServer,
    chain: &[Arc<Lease>],
    edge: Edge<'_>,
    body: &[u8],
) -> (McpTap, Result<Listing, Refusal>) {
    let mut tap = McpTap::unread(server);
    if body.len() > MAX_REQUEST {
        tap.ids = vec![Value::Null];
        let refusal = Refusal::new(
            Code::BodyTooLarge,
            format!("a request to an MCP server is read whole, and this one is over {MAX_REQUEST} bytes"),
        );
        return (tap, Err(refusal));
    }
    let messages = match message::read(body) {
        Ok(messages) => messages,
        Err(unreadable) => {
            tap.ids = vec![Value::Null];
            let refusal = Refusal::new(
                Code::McpUnreadable,
                format!(
                    "the request to MCP server {} cannot be read one way: {unreadable}",
                    server.name
                ),
            );
            return (tap, Err(refusal));
        }
    };
    tap.batch = messages.batch;
    // Notifications and responses only (no ids): an answer in the server's place is plain.
    tap.ids = messages.request_ids();
    let waiting = match verdicts(server, chain, &messages, &mut tap.line) {
        Ok(waiting) => waiting,
        Err(refusal) => return (tap, Err(refusal)),
    };
    // Each call needing a human waits here, before its step is reserved: a held call costs
    // nothing until it goes on; the first refused one refuses the request.
    for (at, named_by) in waiting {
        let m = &messages.messages[at];
        let tool = server.tool(m.tool.as_deref().unwrap_or_default());
        let call = Call {
            chain,
            named_by: &named_by,
            tool: &tool,
            arguments: m.arguments.as_deref().map_or("{}", |a| a.get()),
        };
        match edge.approvals.hold(call, edge.lease_closed).await {
            Ok(approval) => {
                let line = &mut tap.line.messages[at];
                line.verdict = "approved";
                line.approval = Some(approval);
            }
            Err(refusal) => {
                mark_refused(&mut tap.line);
                return (tap, Err(refusal));
            }
        }
    }
    let calls = messages.calls().count() as u64;
    if calls > 0 {
        match metering::reserve(edge.spending, chain, Bound::tool_calls(calls)).await {
            Ok(reservation) => {
                tap.steps = Some(reservation);
                tap.line.steps = calls;
            }
            Err(refusal) => {
                mark_refused(&mut tap.line);
                return (tap, Err(refusal));
            }
        }
    }
    let listing = Listing(messages.lists_tools());
    (tap, Ok(listing))
}

/// Whether the request asks for a tool list: its answer is filtered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listing(pub bool);

/// What a request to an MCP server is judged with besides its chain.
#[derive(Clone, Copy)]
pub struct Edge<'a> {
    pub spending: &'a Arc<Spending>,
    pub approvals: &'a Approvals,
    /// The connection's lease token: cancelled when the lease closes.
    pub lease_closed: &'a CancellationToken,
}

/// Each message's verdict on the line; the first refused tool's refusal, if any, else the
/// calls that wait for a human (their index, and the lease whose `approvals` names them).
fn verdicts(
    server: &McpServer,
    chain: &[Arc<Lease>],
    messages: &Messages,
    line: &mut McpCall,
) -> Result<Vec<(usize, String)>, Refusal> {
    let mut refusal = None;
    let mut waiting = Vec::new();
    for (at, m) in messages.messages.iter().enumerate() {
        let mut verdict = "allowed";
        if let (Some(TOOLS_CALL), Some(tool)) = (m.method.as_deref(), &m.tool) {
            let named = server.tool(tool);
            match judged::judge(chain, &named) {
                ToolVerdict::Allowed => {}
                ToolVerdict::NotAllowed { lease_id } => {
                    verdict = "refused";
                    refusal.get_or_insert_with(|| {
                        Refusal::new(
                            Code::ToolNotAllowed,
                            format!("tool {named} is not in lease {lease_id}'s allow.tools"),
                        )
                    });
                }
                ToolVerdict::NeedsApproval { lease_id } => waiting.push((at, lease_id)),
            }
        }
        line.messages.push(McpMessage {
            method: m.method.clone(),
            tool: m.tool.clone(),
            verdict,
            approval: None,
        });
    }
    match refusal {
        Some(refusal) => {
            mark_refused(line);
            Err(refusal)
        }
        None => Ok(waiting),
    }
}

/// A refused request sends none of its messages.
fn mark_refused(line: &mut McpCall) {
    for m in &mut line.messages {
        m.verdict = "refused";
    }
}

/// The answer's body, every tool list in it cut to what `chain` may call on `server`;
/// `ids` are what an error in the server's place answers, should a list not be readable.
/// `None`: the answer is neither JSON nor an event stream (nothing in it is read).
pub fn filtered(
    framing: Framing,
    body: Incoming,
    server: &McpServer,
    chain: Vec<Arc<Lease>>,
    ids: Vec<Value>,
    hidden: Arc<AtomicU64>,
) -> Body {
    let name = server.name.clone();
    let allowed = move |tool: &str| judged::listed(&chain, &format!("{name}/{tool}"));
    Filtered {
        inner: body,
        filter: Filter::new(framing, Box::new(allowed)),
        framing,
        ids,
        hidden,
        done: false,
    }
    .boxed_unsync()
}

type Allowed = Box<dyn FnMut(&str) -> bool + Send>;

struct Filtered {
    inner: Incoming,
    filter: Filter<Allowed>,
    framing: Framing,
    ids: Vec<Value>,
    hidden: Arc<AtomicU64>,
    done: bool,
}

impl Filtered {
    /// What ends an answer whose list could not be read: a JSON-RPC error to the first request
    /// (the client then has its answer, never a list unread), in the answer's framing.
    fn unread(&mut self, why: &str) -> Bytes {
        let id = self.ids.first().cloned().unwrap_or(Value::Null);
        let error = json!({"jsonrpc": "2.0", "id": id, "error": {"code": REFUSED,
            "message": format!("leasegate could not read the MCP server's tool list, so it is not passed: {why}"),
            "data": {"refusal": Code::McpUnreadable.as_str()}}});
        let text = error.to_string();
        tracing::warn!(%why, "an MCP server's tool list could not be read; the answer was ended");
        match self.framing {
            Framing::Json => Bytes::from(text),
            Framing::Events => Bytes::from(format!("\n\nevent: message\ndata: {text}\n\n")),
        }
    }

    fn count(&self) {
        self.hidden.store(self.filter.hidden, Ordering::Relaxed);
    }
}

impl HttpBody for Filtered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error.into()))),
                Poll::Ready(Some(Ok(frame))) => {
                    let Some(data) = frame.data_ref() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    let mut out = Vec::new();
                    if let Err(unread) = this.filter.feed(data, &mut out) {
                        this.done = true;
                        let ending = this.unread(&unread.0);
                        return Poll::Ready(Some(Ok(Frame::data(ending))));
                    }
                    this.count();
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                    }
                }
                Poll::Ready(None) => {
                    this.done = true;
                    let mut out = Vec::new();
                    let out = match this.filter.finish(&mut out) {
                        Ok(()) => Bytes::from(out),
                        Err(unread) => this.unread(&unread.0),
                    };
                    this.count();
                    return match out.is_empty() {
                        true => Poll::Ready(None),
                        false => Poll::Ready(Some(Ok(Frame::data(out)))),
                    };
                }
            }
        }
    }
}

/// A request to `server`: a POST's body (`ahead`, read whole) judged, anything else only put
/// on the line. The tap, and whether the answer is to be filtered (a POST asking for a tool
/// list; a GET, whose stream may resume one) or the refusal.
pub async fn read(
    server: &McpServer,
    method: &http::Method,
    chain: &[Arc<Lease>],
    edge: Edge<'_>,
    ahead: &[u8],
) -> (Box<McpTap>, Result<bool, Refusal>) {
    if method == http::Method::POST {
        let (tap, verdict) = judge(server, chain, edge, ahead).await;
        return (Box::new(tap), verdict.map(|listing| listing.0));
    }
    (
        Box::new(McpTap::unread(server)),
        Ok(method == http::Method::GET),
    )
}

/// The rewrite of an answer whose tool lists are cut to what `chain` may call, when its
/// `Content-Type` is one the client reads messages from.
pub fn answer_rewrite(
    content_type: Option<&str>,
    server: &McpServer,
    chain: &[Arc<Lease>],
    tap: &McpTap,
) -> Option<Box<dyn FnOnce(Incoming) -> Body + Send>> {
    let framing = Framing::of(content_type)?;
    let (server, chain, ids, hidden) = (
        server.clone(),
        chain.to_vec(),
        tap.ids.clone(),
        tap.hidden(),
    );
    Some(Box::new(move |body| {
        filtered(framing, body, &server, chain, ids, hidden)
    }))
}

/// Whether a refusal met on the way to the server means the request never reached it (its
/// steps are then not charged).
pub fn never_sent(code: Code) -> bool {
    matches!(
        code,
        Code::DnsFailed | Code::AddressNotAllowed | Code::UpstreamTlsFailed
    )
}
