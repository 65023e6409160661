//! etcd's messages on the wire. The store writes its requests, and reads etcd's answers, in
//! etcd's JSON form of them (field names as in `rpc.proto`, int64s as strings, bytes as
//! base64, enums by name); this module turns that form into protobuf and back, by the
//! schemas of the few messages the store sends and reads. A field a schema does not name is
//! an error when sent (a typo would otherwise vanish) and skipped when read.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Map, Value};

use crate::StateError;

/// How one field's value is written.
pub(super) enum Kind {
    Int,
    Uint,
    Bool,
    Bytes,
    Str,
    /// An enum, its names by number.
    Enum(&'static [&'static str]),
    Message(&'static [Field]),
}

pub(super) struct Field {
    pub name: &'static str,
    pub number: u32,
    pub kind: Kind,
    pub repeated: bool,
}

const fn one(name: &'static str, number: u32, kind: Kind) -> Field {
    Field {
        name,
        number,
        kind,
        repeated: false,
    }
}

const fn many(name: &'static str, number: u32, kind: Kind) -> Field {
    Field {
        name,
        number,
        kind,
        repeated: true,
    }
}

pub(super) static HEADER: [Field; 4] = [
    one("cluster_id", 1, Kind::Uint),
    one("member_id", 2, Kind::Uint),
    one("revision", 3, Kind::Int),
    one("raft_term", 4, Kind::Uint),
];

pub(super) static KEY_VALUE: [Field; 6] = [
    one("key", 1, Kind::Bytes),
    one("create_revision", 2, Kind::Int),
    one("mod_revision", 3, Kind::Int),
    one("version", 4, Kind::Int),
    one("value", 5, Kind::Bytes),
    one("lease", 6, Kind::Int),
];

pub(super) static RANGE_REQUEST: [Field; 9] = [
    one("key", 1, Kind::Bytes),
    one("range_end", 2, Kind::Bytes),
    one("limit", 3, Kind::Int),
    one("revision", 4, Kind::Int),
    one("serializable", 7, Kind::Bool),
    one("keys_only", 8, Kind::Bool),
    one("count_only", 9, Kind::Bool),
    one("min_mod_revision", 10, Kind::Int),
    one("max_mod_revision", 11, Kind::Int),
];

pub(super) static RANGE_RESPONSE: [Field; 4] = [
    one("header", 1, Kind::Message(&HEADER)),
    many("kvs", 2, Kind::Message(&KEY_VALUE)),
    one("more", 3, Kind::Bool),
    one("count", 4, Kind::Int),
];

static PUT_REQUEST: [Field; 4] = [
    one("key", 1, Kind::Bytes),
    one("value", 2, Kind::Bytes),
    one("lease", 3, Kind::Int),
    one("prev_kv", 4, Kind::Bool),
];

static PUT_RESPONSE: [Field; 2] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("prev_kv", 2, Kind::Message(&KEY_VALUE)),
];

static DELETE_RANGE_REQUEST: [Field; 3] = [
    one("key", 1, Kind::Bytes),
    one("range_end", 2, Kind::Bytes),
    one("prev_kv", 3, Kind::Bool),
];

static DELETE_RANGE_RESPONSE: [Field; 3] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("deleted", 2, Kind::Int),
    many("prev_kvs", 3, Kind::Message(&KEY_VALUE)),
];

static COMPARE: [Field; 8] = [
    one(
        "result",
        1,
        Kind::Enum(&["EQUAL", "GREATER", "LESS", "NOT_EQUAL"]),
    ),
    one(
        "target",
        2,
        Kind::Enum(&["VERSION", "CREATE", "MOD", "VALUE", "LEASE"]),
    ),
    one("key", 3, Kind::Bytes),
    one("version", 4, Kind::Int),
    one("create_revision", 5, Kind::Int),
    one("mod_revision", 6, Kind::Int),
    one("value", 7, Kind::Bytes),
    one("lease", 8, Kind::Int),
];

static REQUEST_OP: [Field; 4] = [
    one("request_range", 1, Kind::Message(&RANGE_REQUEST)),
    one("request_put", 2, Kind::Message(&PUT_REQUEST)),
    one(
        "request_delete_range",
        3,
        Kind::Message(&DELETE_RANGE_REQUEST),
    ),
    one("request_txn", 4, Kind::Message(&TXN_REQUEST)),
];

static RESPONSE_OP: [Field; 4] = [
    one("response_range", 1, Kind::Message(&RANGE_RESPONSE)),
    one("response_put", 2, Kind::Message(&PUT_RESPONSE)),
    one(
        "response_delete_range",
        3,
        Kind::Message(&DELETE_RANGE_RESPONSE),
    ),
    one("response_txn", 4, Kind::Message(&TXN_RESPONSE)),
];

pub(super) static TXN_REQUEST: [Field; 3] = [
    many("compare", 1, Kind::Message(&COMPARE)),
    many("success", 2, Kind::Message(&REQUEST_OP)),
    many("failure", 3, Kind::Message(&REQUEST_OP)),
];

pub(super) static TXN_RESPONSE: [Field; 3] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("succeeded", 2, Kind::Bool),
    many("responses", 3, Kind::Message(&RESPONSE_OP)),
];

pub(super) static COMPACTION_REQUEST: [Field; 2] = [
    one("revision", 1, Kind::Int),
    one("physical", 2, Kind::Bool),
];

/// Answers that carry nothing the store reads but their header.
pub(super) static HEADER_ONLY: [Field; 1] = [one("header", 1, Kind::Message(&HEADER))];

pub(super) static LEASE_GRANT_REQUEST: [Field; 2] =
    [one("TTL", 1, Kind::Int), one("ID", 2, Kind::Int)];

pub(super) static LEASE_GRANT_RESPONSE: [Field; 4] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("ID", 2, Kind::Int),
    one("TTL", 3, Kind::Int),
    one("error", 4, Kind::Str),
];

/// `LeaseRevokeRequest` and `LeaseKeepAliveRequest`.
pub(super) static LEASE_ID: [Field; 1] = [one("ID", 1, Kind::Int)];

pub(super) static LEASE_KEEP_ALIVE_RESPONSE: [Field; 3] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("ID", 2, Kind::Int),
    one("TTL", 3, Kind::Int),
];

pub(super) static AUTHENTICATE_REQUEST: [Field; 2] =
    [one("name", 1, Kind::Str), one("password", 2, Kind::Str)];

pub(super) static AUTHENTICATE_RESPONSE: [Field; 2] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("token", 2, Kind::Str),
];

pub(super) static SNAPSHOT_REQUEST: [Field; 0] = [];

pub(super) static SNAPSHOT_RESPONSE: [Field; 3] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("remaining_bytes", 2, Kind::Uint),
    one("blob", 3, Kind::Bytes),
];

static WATCH_CREATE_REQUEST: [Field; 5] = [
    one("key", 1, Kind::Bytes),
    one("range_end", 2, Kind::Bytes),
    one("start_revision", 3, Kind::Int),
    one("progress_notify", 4, Kind::Bool),
    one("prev_kv", 6, Kind::Bool),
];

pub(super) static WATCH_REQUEST: [Field; 1] = [one(
    "create_request",
    1,
    Kind::Message(&WATCH_CREATE_REQUEST),
)];

static EVENT: [Field; 3] = [
    one("type", 1, Kind::Enum(&["PUT", "DELETE"])),
    one("kv", 2, Kind::Message(&KEY_VALUE)),
    one("prev_kv", 3, Kind::Message(&KEY_VALUE)),
];

pub(super) static WATCH_RESPONSE: [Field; 8] = [
    one("header", 1, Kind::Message(&HEADER)),
    one("watch_id", 2, Kind::Int),
    one("created", 3, Kind::Bool),
    one("canceled", 4, Kind::Bool),
    one("compact_revision", 5, Kind::Int),
    one("cancel_reason", 6, Kind::Str),
    one("fragment", 7, Kind::Bool),
    many("events", 11, Kind::Message(&EVENT)),
];

const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LENGTH: u32 = 2;
const FIXED32: u32 = 5;

fn bad(what: String) -> StateError {
    StateError::Failed(format!("etcd message: {what}"))
}

/// The protobuf of `value` (a JSON object) as message `schema`.
pub(super) fn encode(schema: &[Field], value: &Value) -> Result<Vec<u8>, StateError> {
    let mut out = Vec::new();
    encode_into(schema, value, &mut out)?;
    Ok(out)
}

fn encode_into(schema: &[Field], value: &Value, out: &mut Vec<u8>) -> Result<(), StateError> {
    let Some(object) = value.as_object() else {
        return Err(bad(format!("not an object: {value}")));
    };
    for (name, value) in object {
        let field = schema
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| bad(format!("no field {name}")))?;
        match (field.repeated, value) {
            (true, Value::Array(items)) => {
                for item in items {
                    encode_field(field, item, out)?;
                }
            }
            (true, other) => return Err(bad(format!("{name} is not a list: {other}"))),
            (false, value) => encode_field(field, value, out)?,
        }
    }
    Ok(())
}

fn encode_field(field: &Field, value: &Value, out: &mut Vec<u8>) -> Result<(), StateError> {
    let name = field.name;
    let number = |value: &Value| integer(name, value);
    match &field.kind {
        Kind::Int | Kind::Uint => {
            tag(field.number, VARINT, out);
            varint(number(value)?, out);
        }
        Kind::Bool => {
            let Value::Bool(b) = value else {
                return Err(bad(format!("{name} is not a boolean: {value}")));
            };
            tag(field.number, VARINT, out);
            varint(u64::from(*b), out);
        }
        Kind::Enum(names) => {
            let index = match value {
                Value::String(s) => match names.iter().position(|n| n == s) {
                    Some(i) => i as u64,
                    None => number(value)?,
                },
                other => number(other)?,
            };
            tag(field.number, VARINT, out);
            varint(index, out);
        }
        Kind::Bytes => {
            let bytes = value
                .as_str()
                .map(|text| B64.decode(text))
                .ok_or_else(|| bad(format!("{name} is not a string: {value}")))?
                .map_err(|e| bad(format!("{name} is not base64: {e}")))?;
            length_delimited(field.number, &bytes, out);
        }
        Kind::Str => {
            let Value::String(s) = value else {
                return Err(bad(format!("{name} is not a string: {value}")));
            };
            length_delimited(field.number, s.as_bytes(), out);
        }
        Kind::Message(schema) => {
            let mut inner = Vec::new();
            encode_into(schema, value, &mut inner)?;
            length_delimited(field.number, &inner, out);
        }
    }
    Ok(())
}

/// An int64 or uint64 as JSON carries it: a string or a number.
fn integer(name: &str, value: &Value) -> Result<u64, StateError> {
    let n = match value {
        Value::String(s) => (s.parse::<i64>().ok().map(|n| n as u64)).or(s.parse::<u64>().ok()),
        Value::Number(n) => n.as_i64().map(|n| n as u64).or(n.as_u64()),
        _ => None,
    };
    n.ok_or_else(|| bad(format!("{name} is not an integer: {value}")))
}

fn tag(number: u32, wire: u32, out: &mut Vec<u8>) {
    varint(u64::from((number << 3) | wire), out);
}

fn varint(mut n: u64, out: &mut Vec<u8>) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn length_delimited(number: u32, bytes: &[u8], out: &mut Vec<u8>) {
    tag(number, LENGTH, out);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// The JSON form of `bytes`, a protobuf message `schema`.
pub(super) fn decode(schema: &[Field], bytes: &[u8]) -> Result<Value, StateError> {
    let mut object = Map::new();
    let mut input = bytes;
    while !input.is_empty() {
        let key = read_varint(&mut input)?;
        let (number, wire) = ((key >> 3) as u32, (key & 7) as u32);
        let field = schema.iter().find(|f| f.number == number);
        let value = match wire {
            VARINT => {
                let n = read_varint(&mut input)?;
                match field.map(|f| &f.kind) {
                    Some(Kind::Int) => Value::String((n as i64).to_string()),
                    Some(Kind::Uint) => Value::String(n.to_string()),
                    Some(Kind::Bool) => Value::Bool(n != 0),
                    Some(Kind::Enum(names)) => match names.get(n as usize) {
                        Some(name) => Value::String((*name).to_string()),
                        None => Value::from(n),
                    },
                    _ => continue,
                }
            }
            LENGTH => {
                let len = read_varint(&mut input)? as usize;
                if len > input.len() {
                    return Err(bad("a field runs past the end".into()));
                }
                let (data, rest) = input.split_at(len);
                input = rest;
                match field.map(|f| &f.kind) {
                    Some(Kind::Bytes) => Value::String(B64.encode(data)),
                    Some(Kind::Str) => Value::String(String::from_utf8_lossy(data).into_owned()),
                    Some(Kind::Message(schema)) => decode(schema, data)?,
                    _ => continue,
                }
            }
            FIXED64 | FIXED32 => {
                let len = if wire == FIXED64 { 8 } else { 4 };
                if len > input.len() {
                    return Err(bad("a field runs past the end".into()));
                }
                input = &input[len..];
                continue;
            }
            other => return Err(bad(format!("wire type {other}"))),
        };
        let field = field.expect("a value only for a known field");
        if field.repeated {
            match object
                .entry(field.name)
                .or_insert_with(|| Value::Array(Vec::new()))
            {
                Value::Array(items) => items.push(value),
                _ => unreachable!("a repeated field is a list"),
            }
        } else {
            object.insert(field.name.to_string(), value);
        }
    }
    Ok(Value::Object(object))
}

fn read_varint(input: &mut &[u8]) -> Result<u64, StateError> {
    let mut n = 0u64;
    for shift in (0..64).step_by(7) {
        let Some((&byte, rest)) = input.split_first() else {
            break;
        };
        *input = rest;
        n |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(n);
        }
    }
    Err(bad("a varint runs past the end".into()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_transaction_goes_to_protobuf_as_etcd_reads_it() {
        // TxnRequest{success: [RequestOp{request_put: PutRequest{key: "k", value: "v"}}]},
        // written out by hand from rpc.proto's field numbers.
        let put = json!({"success": [{"request_put": {"key": B64.encode("k"), "value": B64.encode("v")}}]});
        assert_eq!(
            encode(&TXN_REQUEST, &put).unwrap(),
            [0x12, 8, 0x12, 6, 0x0a, 1, b'k', 0x12, 1, b'v']
        );
        // Every field given is sent, zeros too (a compare's revision is a oneof member,
        // present even at 0), and reads back as it was; an empty list sends nothing.
        let request = json!({
            "compare": [{"key": B64.encode("k"), "target": "CREATE", "create_revision": "0", "result": "EQUAL"}],
            "success": [{"request_txn": {"success": [{"request_range": {"key": B64.encode("k"), "count_only": true}}]}}],
            "failure": [],
        });
        let bytes = encode(&TXN_REQUEST, &request).unwrap();
        assert_eq!(
            decode(&TXN_REQUEST, &bytes).unwrap(),
            json!({
                "compare": [{"key": B64.encode("k"), "target": "CREATE", "create_revision": "0", "result": "EQUAL"}],
                "success": [{"request_txn": {"success": [{"request_range": {"key": B64.encode("k"), "count_only": true}}]}}],
            }),
        );
        assert!(bytes.windows(2).any(|w| w == [0x28, 0]), "{bytes:x?}");
    }

    #[test]
    fn answers_read_back_in_etcds_json_form() {
        let kv = encode(
            &KEY_VALUE,
            &json!({"key": B64.encode("a"), "mod_revision": "-1", "value": B64.encode([0u8, 255])}),
        )
        .unwrap();
        let mut range = Vec::new();
        length_delimited(2, &kv, &mut range);
        length_delimited(2, &kv, &mut range);
        // A field this schema does not know (99, fixed64) is skipped.
        tag(99, FIXED64, &mut range);
        range.extend([0; 8]);
        tag(4, VARINT, &mut range);
        varint(2, &mut range);
        let value = decode(&RANGE_RESPONSE, &range).unwrap();
        assert_eq!(value["count"], "2");
        assert_eq!(value["kvs"].as_array().unwrap().len(), 2);
        assert_eq!(value["kvs"][1]["mod_revision"], "-1");
        assert_eq!(value["kvs"][1]["value"], B64.encode([0u8, 255]));
    }

    #[test]
    fn unknown_fields_and_bad_values_are_refused_when_sent() {
        assert!(encode(&RANGE_REQUEST, &json!({"kee": "eA=="})).is_err());
        assert!(encode(&RANGE_REQUEST, &json!({"limit": "ten"})).is_err());
        assert!(encode(&TXN_REQUEST, &json!({"compare": {}})).is_err());
        assert!(encode(&RANGE_REQUEST, &json!({"key": 7})).is_err());
        assert!(decode(&RANGE_RESPONSE, &[0x12, 5, 1]).is_err(), "truncated");
    }
}
