//! The admin API's OpenAPI document (`schemas/admin-api.openapi.json`) as a check on every
//! admin answer the tests see: the operation for the request's method and path (`{id}`
//! templates matched, the server's own path rules: query and trailing `/` left out), the
//! response for the answer's status, its media type, its required headers and, for JSON, its
//! body against the response's JSON Schema (2020-12, the document's `components` resolved from
//! a registry that holds the document and the egress log's schema).
//!
//! Invariant: an answer passes only if the document declares its (operation, status) and the
//! answer is what that response says; a request no operation describes is held to the
//! document's `x-leasegate-unrouted` responses (another method on a listed path, another
//! path). A request that got no answer at all (status 0) is not checked.

use jsonschema::{Draft, Registry, Validator};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, LazyLock, Mutex};

/// The document, as checked in.
const DOCUMENT: &str = include_str!("../../../schemas/admin-api.openapi.json");

/// The egress log's schema, which the document's `EgressEvent` refers to (a sibling file).
const EGRESS_EVENT: &str = include_str!("../../../schemas/egress-event.schema.json");

/// Where the document sits beside the egress log's schema (its `$id`), so that the document's
/// relative `egress-event.schema.json` resolves to it.
const BASE: &str = "https://leasegate.dev/schemas/1.x/admin-api.openapi.json";

/// The operation of another method on a listed path, and of a path no route has.
pub const OTHER_METHOD: &str = "other method";
pub const OTHER_PATH: &str = "other path";

/// Which response of the document an answer was checked against.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Answered {
    /// `GET /leases/{id}`, or [`OTHER_METHOD`] or [`OTHER_PATH`].
    pub operation: String,
    pub status: u16,
}

struct Spec {
    document: Value,
    registry: Registry<'static>,
    /// Compiled response and header schemas, by their text.
    validators: Mutex<HashMap<String, Arc<Validator>>>,
}

static SPEC: LazyLock<Spec> = LazyLock::new(|| {
    let document: Value = serde_json::from_str(DOCUMENT).expect("the OpenAPI document is JSON");
    let egress: Value = serde_json::from_str(EGRESS_EVENT).expect("the egress schema is JSON");
    let egress_id = egress["$id"]
        .as_str()
        .expect("the egress schema has an $id")
        .to_owned();
    let registry = Registry::new()
        .add(BASE, Draft::Draft202012.create_resource(document.clone()))
        .and_then(|r| r.add(egress_id, egress))
        .and_then(|r| r.prepare())
        .expect("the document and the egress schema make a registry");
    Spec {
        document,
        registry,
        validators: Mutex::new(HashMap::new()),
    }
});

/// `schema` with its document-local references (`#/components/...`) made absolute, so that
/// they resolve in the registered document.
fn anchored(schema: &Value) -> Value {
    match schema {
        Value::Object(members) => Value::Object(
            members
                .iter()
                .map(|(k, v)| match (k.as_str(), v) {
                    ("$ref", Value::String(r)) if r.starts_with('#') => {
                        (k.clone(), Value::String(format!("{BASE}{r}")))
                    }
                    _ => (k.clone(), anchored(v)),
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(anchored).collect()),
        other => other.clone(),
    }
}

impl Spec {
    /// The compiled validator of `schema` (a schema from the document).
    fn validator(&'static self, schema: &Value) -> Arc<Validator> {
        let key = schema.to_string();
        let mut validators = self.validators.lock().unwrap_or_else(|e| e.into_inner());
        validators
            .entry(key)
            .or_insert_with(|| {
                let built = jsonschema::options()
                    .with_draft(Draft::Draft202012)
                    .with_registry(&self.registry)
                    .offline()
                    .build(&anchored(schema))
                    .unwrap_or_else(|e| {
                        panic!("a schema of the document does not compile: {e}: {schema}")
                    });
                Arc::new(built)
            })
            .clone()
    }

    /// What `value` (a Reference Object or not) refers to in the document.
    fn resolved<'a>(&'a self, value: &'a Value) -> &'a Value {
        match value.get("$ref").and_then(Value::as_str) {
            Some(r) => {
                let pointer = r
                    .strip_prefix('#')
                    .expect("a reference inside the document");
                self.document
                    .pointer(pointer)
                    .unwrap_or_else(|| panic!("the document has no {r}"))
            }
            None => value,
        }
    }

    /// The operation `method target` is, and the responses it declares.
    fn operation(&self, method: &str, target: &str) -> (String, &Value) {
        // The path as the server reads it (an absolute-form target's too), without the query.
        let uri = target.parse::<http::Uri>().ok();
        let path = match &uri {
            Some(uri) => uri.path(),
            None => target.split(['?', '#']).next().unwrap_or(""),
        };
        let asked = segments(path);
        let unrouted = &self.document["x-leasegate-unrouted"];
        let paths = self.document["paths"].as_object().expect("paths");
        let matched = paths.iter().find(|(template, _)| {
            let template = segments(template);
            template.len() == asked.len()
                && template
                    .iter()
                    .zip(&asked)
                    .all(|(t, a)| (t.starts_with('{') && t.ends_with('}')) || t == a)
        });
        match matched {
            Some((template, item)) => match item.get(method.to_ascii_lowercase()) {
                Some(operation) => (format!("{method} {template}"), &operation["responses"]),
                None => (
                    OTHER_METHOD.to_owned(),
                    &unrouted["otherMethod"]["responses"],
                ),
            },
            None => (OTHER_PATH.to_owned(), &unrouted["otherPath"]["responses"]),
        }
    }
}

/// A path's segments as the admin API routes it: trailing `/` left out, split on `/`.
fn segments(path: &str) -> Vec<&str> {
    path.trim_end_matches('/').split('/').skip(1).collect()
}

/// Checks `answer` (the raw HTTP response) to `method target` against the document, and says
/// which response it was; panics, saying why, when the document does not describe it. `None`:
/// no answer came (nothing to check).
#[track_caller]
pub fn check(method: &str, target: &str, answer: &str) -> Option<Answered> {
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((answer, ""));
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let fail = |why: String| -> ! {
        let shown: String = answer.chars().take(3000).collect();
        panic!(
            "the admin API's answer to {method} {target} is not what \
             schemas/admin-api.openapi.json says: {why}\n{shown}"
        )
    };
    let spec: &'static Spec = &SPEC;
    let (operation, responses) = spec.operation(method, target);
    let Some(response) = responses.get(status.to_string()) else {
        fail(format!("{operation} declares no {status} answer"))
    };
    let response = spec.resolved(response);
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    };
    for (name, declared) in response["headers"].as_object().into_iter().flatten() {
        let declared = spec.resolved(declared);
        let Some(value) = header(name) else {
            if declared["required"] == true {
                fail(format!("{operation} {status} has no {name} header"));
            }
            continue;
        };
        let schema = &declared["schema"];
        let value = match schema["type"].as_str() {
            Some("integer") => value
                .parse::<i64>()
                .map(Value::from)
                .unwrap_or_else(|_| fail(format!("{name}: {value:?} is not an integer"))),
            _ => json!(value),
        };
        if let Err(e) = spec.validator(schema).validate(&value) {
            fail(format!("{operation} {status}, header {name}: {e}"));
        }
    }
    let content = response["content"]
        .as_object()
        .unwrap_or_else(|| fail(format!("{operation} {status} declares no content")));
    let media = header("content-type")
        .and_then(|v| v.split(';').next())
        .map(|m| m.trim().to_ascii_lowercase())
        .unwrap_or_else(|| fail("no Content-Type".into()));
    let Some(declared) = content.get(&media) else {
        fail(format!(
            "{operation} {status} answers {:?}, not {media}",
            content.keys().collect::<Vec<_>>()
        ))
    };
    // A HEAD answer has no body.
    if media == "application/json" && !method.eq_ignore_ascii_case("HEAD") {
        let value: Value = serde_json::from_str(body)
            .unwrap_or_else(|e| fail(format!("the body is not JSON: {e}")));
        let validator = spec.validator(&declared["schema"]);
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| format!("{}: {e}", e.instance_path()))
            .collect();
        if !errors.is_empty() {
            fail(format!("{operation} {status}: {}", errors.join("; ")));
        }
    }
    Some(Answered { operation, status })
}

/// Every (operation, status) the document declares, the unrouted ones included.
pub fn declared() -> BTreeSet<Answered> {
    let spec: &Spec = &SPEC;
    let mut all = BTreeSet::new();
    let mut add = |operation: String, responses: &Value| {
        for status in responses.as_object().expect("responses").keys() {
            let status = status.parse().expect("a status code");
            all.insert(Answered {
                operation: operation.clone(),
                status,
            });
        }
    };
    for (template, item) in spec.document["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("a path item") {
            if method != "parameters" {
                let method = method.to_ascii_uppercase();
                add(format!("{method} {template}"), &operation["responses"]);
            }
        }
    }
    let unrouted = &spec.document["x-leasegate-unrouted"];
    add(OTHER_METHOD.into(), &unrouted["otherMethod"]["responses"]);
    add(OTHER_PATH.into(), &unrouted["otherPath"]["responses"]);
    all
}

/// Compiles every schema of every response and header the document declares (a schema that
/// does not compile, or a reference that does not resolve, fails here rather than on the one
/// answer that needs it).
pub fn compile_all() {
    let spec: &'static Spec = &SPEC;
    let mut responses: Vec<&Value> = Vec::new();
    for item in spec.document["paths"].as_object().expect("paths").values() {
        for (method, operation) in item.as_object().expect("a path item") {
            if method != "parameters" {
                responses.extend(
                    operation["responses"]
                        .as_object()
                        .expect("responses")
                        .values(),
                );
            }
        }
    }
    for unrouted in ["otherMethod", "otherPath"] {
        let declared = &spec.document["x-leasegate-unrouted"][unrouted]["responses"];
        responses.extend(declared.as_object().expect("responses").values());
    }
    for response in responses {
        let response = spec.resolved(response);
        for header in response["headers"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(_, h)| h)
        {
            spec.validator(&spec.resolved(header)["schema"]);
        }
        for media in response["content"].as_object().expect("content").values() {
            spec.validator(&media["schema"]);
        }
    }
    for schema in spec.document["components"]["schemas"]
        .as_object()
        .expect("schemas")
        .keys()
    {
        spec.validator(&json!({"$ref": format!("#/components/schemas/{schema}")}));
    }
}
