//! The DNS forwarder's wire parser (`fastbox_runtime::net::dns_forwarder::message`) on
//! arbitrary messages, read both as a sandbox's query and as an upstream's answer.
#![no_main]

use fastbox_runtime::net::dns_forwarder::message::{self, FORMERR, HEADER_LEN, NOERROR, NXDOMAIN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As a query: the question, then the replies the forwarder builds from it.
    match message::question(data) {
        Ok(q) => {
            assert!(q.end <= data.len(), "question ends past the message");
            assert!(q.end > HEADER_LEN, "question inside the header");
            assert!(q.name.len() <= 253, "name longer than 253 bytes");
            assert!(
                q.name
                    .split('.')
                    .all(|label| !label.is_empty() || q.name.is_empty()),
                "empty label in {:?}",
                q.name
            );
            assert!(
                q.name.bytes().all(|b| b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'-' | b'_' | b'.')),
                "name {:?} is not a lower-case host name",
                q.name
            );
            for rcode in [NOERROR, NXDOMAIN] {
                let reply = message::reply_with_rcode(data, q.end, rcode);
                assert_eq!(reply.len(), q.end, "a refusal echoes the question only");
                assert_eq!(reply[..2], data[..2], "a refusal keeps the id");
                assert_eq!(reply[3] & 0x0f, rcode);
                assert_eq!(reply[HEADER_LEN..], data[HEADER_LEN..q.end]);
            }
        }
        Err(_) => {
            let reply = message::format_error(data);
            assert_eq!(reply.len(), HEADER_LEN, "FORMERR is a header only");
            assert_eq!(reply[3] & 0x0f, FORMERR);
        }
    }
    // Whatever `question_end` a caller passes, a reply is built without panicking.
    if let Some(&b) = data.first() {
        let _ = message::reply_with_rcode(data, usize::from(b) * 4, NXDOMAIN);
    }
    // As an answer: the A records the name policy learns.
    if let Ok(records) = message::a_records(data) {
        // Each A record takes 15 bytes at least: a name of one byte or more, type, class,
        // TTL, length and the four bytes of its address.
        assert!(
            records.len() * 15 <= data.len().saturating_sub(HEADER_LEN),
            "more records than bytes"
        );
    }
});
