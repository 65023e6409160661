//! Just enough of the DNS wire format (RFC 1035 §4) for name policy: the question of a
//! query, the A records of an answer, and refusals built from a query.
//!
//! Names are read with compression pointers (bounded, so a pointer loop is an error), and
//! only as host names: a label with a byte outside `[A-Za-z0-9_-]` is refused, so no label
//! can smuggle a `.` past a policy that compares names as text.

use std::net::Ipv4Addr;

/// Length of the header.
pub const HEADER_LEN: usize = 12;
/// RCODE: no error.
pub const NOERROR: u8 = 0;
/// RCODE: format error.
pub const FORMERR: u8 = 1;
/// RCODE: no such name.
pub const NXDOMAIN: u8 = 3;

const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;
/// More pointer jumps than this in one name is a loop.
const MAX_JUMPS: usize = 32;
/// Longest name in presentation form.
const MAX_NAME_LEN: usize = 253;

/// What cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// The message ends inside a field.
    #[error("dns message truncated")]
    Truncated,
    /// Not exactly one question.
    #[error("dns query has {0} questions, expected 1")]
    QuestionCount(u16),
    /// A name is not a host name (bad label byte, too long, pointer loop, bad label type).
    #[error("dns name is not a host name: {0}")]
    BadName(&'static str),
}

/// The question of a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// The name asked for: lower case, no trailing dot (`""` for the root).
    pub name: String,
    /// QTYPE.
    pub qtype: u16,
    /// Offset just past the question section.
    pub end: usize,
}

/// The only question of `msg`.
pub fn question(msg: &[u8]) -> Result<Question, MessageError> {
    let qdcount = u16_at(msg, 4)?;
    if qdcount != 1 {
        return Err(MessageError::QuestionCount(qdcount));
    }
    let (name, after) = read_name(msg, HEADER_LEN)?;
    let qtype = u16_at(msg, after)?;
    u16_at(msg, after + 2)?; // QCLASS
    Ok(Question {
        name,
        qtype,
        end: after + 4,
    })
}

/// A query for the A records of `name` with `id`, recursion desired.
pub fn a_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// The A records (class IN) of the answer section, with their TTLs in seconds, whatever
/// name owns them (a CNAME chain's target owns them when the question's name is an alias).
pub fn a_records(msg: &[u8]) -> Result<Vec<(Ipv4Addr, u32)>, MessageError> {
    let qdcount = u16_at(msg, 4)?;
    let ancount = u16_at(msg, 6)?;
    let mut at = HEADER_LEN;
    for _ in 0..qdcount {
        at = skip_name(msg, at)? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..ancount {
        at = skip_name(msg, at)?;
        let rtype = u16_at(msg, at)?;
        let class = u16_at(msg, at + 2)?;
        let ttl = u32::from_be_bytes(bytes_at::<4>(msg, at + 4)?);
        let rdlen = usize::from(u16_at(msg, at + 8)?);
        let rdata = at + 10;
        if msg.len() < rdata + rdlen {
            return Err(MessageError::Truncated);
        }
        if rtype == TYPE_A && class == CLASS_IN && rdlen == 4 {
            out.push((Ipv4Addr::from(bytes_at::<4>(msg, rdata)?), ttl));
        }
        at = rdata + rdlen;
    }
    Ok(out)
}

/// A response to `query` with `rcode`, echoing its question (`question_end` is
/// [`Question::end`]) and nothing else: id, opcode and RD kept, RA set.
pub fn reply_with_rcode(query: &[u8], question_end: usize, rcode: u8) -> Vec<u8> {
    let end = question_end.min(query.len());
    let mut reply = query[..end].to_vec();
    if reply.len() < HEADER_LEN {
        reply.resize(HEADER_LEN, 0);
    }
    // QR = response, opcode and RD kept, AA and TC cleared; RA set, Z cleared, RCODE.
    reply[2] = (reply[2] | 0x80) & 0xf9;
    reply[3] = 0x80 | (rcode & 0x0f);
    let qdcount: u16 = if end > HEADER_LEN { 1 } else { 0 };
    reply[4..6].copy_from_slice(&qdcount.to_be_bytes());
    reply[6..12].fill(0);
    reply
}

/// The response for a query that cannot be read: FORMERR, header only.
pub fn format_error(query: &[u8]) -> Vec<u8> {
    reply_with_rcode(query, HEADER_LEN, FORMERR)
}

fn u16_at(msg: &[u8], at: usize) -> Result<u16, MessageError> {
    Ok(u16::from_be_bytes(bytes_at::<2>(msg, at)?))
}

fn bytes_at<const N: usize>(msg: &[u8], at: usize) -> Result<[u8; N], MessageError> {
    msg.get(at..at + N)
        .and_then(|s| s.try_into().ok())
        .ok_or(MessageError::Truncated)
}

/// Reads the name at `at`; returns it and the offset just past it (past the first pointer,
/// if it uses one).
fn read_name(msg: &[u8], mut at: usize) -> Result<(String, usize), MessageError> {
    let mut name = String::new();
    let mut end = None;
    let mut jumps = 0;
    loop {
        let len = *msg.get(at).ok_or(MessageError::Truncated)?;
        match len & 0xc0 {
            0x00 if len == 0 => {
                return Ok((name, end.unwrap_or(at + 1)));
            }
            0x00 => {
                let label = msg
                    .get(at + 1..at + 1 + usize::from(len))
                    .ok_or(MessageError::Truncated)?;
                if !label
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
                {
                    return Err(MessageError::BadName(
                        "a label has a byte outside [A-Za-z0-9_-]",
                    ));
                }
                if !name.is_empty() {
                    name.push('.');
                }
                name.extend(label.iter().map(|b| b.to_ascii_lowercase() as char));
                if name.len() > MAX_NAME_LEN {
                    return Err(MessageError::BadName("longer than 253 bytes"));
                }
                at += 1 + usize::from(len);
            }
            0xc0 => {
                let low = *msg.get(at + 1).ok_or(MessageError::Truncated)?;
                jumps += 1;
                if jumps > MAX_JUMPS {
                    return Err(MessageError::BadName("compression pointer loop"));
                }
                end.get_or_insert(at + 2);
                at = (usize::from(len & 0x3f) << 8) | usize::from(low);
            }
            _ => return Err(MessageError::BadName("unknown label type")),
        }
    }
}

/// The offset just past the name at `at`, without reading it as a host name (answers may
/// own records under any name).
fn skip_name(msg: &[u8], mut at: usize) -> Result<usize, MessageError> {
    loop {
        let len = *msg.get(at).ok_or(MessageError::Truncated)?;
        match len & 0xc0 {
            0x00 if len == 0 => return Ok(at + 1),
            0x00 => at += 1 + usize::from(len),
            0xc0 => {
                msg.get(at + 1).ok_or(MessageError::Truncated)?;
                return Ok(at + 2);
            }
            _ => return Err(MessageError::BadName("unknown label type")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query for `name`, type `qtype`, id 0xbeef, RD set, with one OPT record.
    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0xbe, 0xef, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1];
        for label in name.split('.').filter(|l| !l.is_empty()) {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&[0, 1]);
        q.extend_from_slice(&[0, 0, 41, 4, 0xd0, 0, 0, 0, 0, 0, 0]); // OPT
        q
    }

    #[test]
    fn reads_the_question_in_lower_case() {
        let q = query("API.Example.com", 1);
        let question = question(&q).unwrap();
        assert_eq!(question.name, "api.example.com");
        assert_eq!(question.qtype, 1);
        assert_eq!(question.end, q.len() - 11);
        assert_eq!(super::question(&query("", 2)).unwrap().name, "");
    }

    #[test]
    fn refuses_names_that_are_not_host_names() {
        let mut q = query("a.example.com", 1);
        q[13] = b'.'; // the label "a" becomes "."
        assert!(matches!(question(&q), Err(MessageError::BadName(_))));
        let mut loop_q = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        loop_q.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
        assert_eq!(
            question(&loop_q),
            Err(MessageError::BadName("compression pointer loop"))
        );
        let mut two = query("a.b", 1);
        two[5] = 2;
        assert_eq!(question(&two), Err(MessageError::QuestionCount(2)));
        assert_eq!(question(&q[..5]), Err(MessageError::Truncated));
        let long = [&"a".repeat(63)[..]; 5].join(".");
        assert!(matches!(
            question(&query(&long, 1)),
            Err(MessageError::BadName(_))
        ));
    }

    /// An answer to `q`: a CNAME for the question, then A records under the alias.
    fn answer(q: &[u8], records: &[([u8; 4], u32)]) -> Vec<u8> {
        let end = question(q).unwrap().end;
        let mut r = q[..end].to_vec();
        r[2] |= 0x80;
        r[3] = 0x80;
        r[7] = 1 + records.len() as u8;
        r[10..12].fill(0);
        // CNAME: owner = question name (pointer to 12), rdata = "cdn" + pointer to 12.
        r.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 30, 0, 6, 3, b'c', b'd', b'n']);
        r.extend_from_slice(&[0xc0, 12]);
        let alias = end + 12;
        for (ip, ttl) in records {
            r.extend_from_slice(&[0xc0 | (alias >> 8) as u8, alias as u8, 0, 1, 0, 1]);
            r.extend_from_slice(&ttl.to_be_bytes());
            r.extend_from_slice(&[0, 4]);
            r.extend_from_slice(ip);
        }
        r
    }

    #[test]
    fn collects_a_records_with_their_ttls_across_a_cname() {
        let q = query("www.example.com", 1);
        let r = answer(&q, &[([192, 0, 2, 1], 300), ([192, 0, 2, 2], 5)]);
        assert_eq!(
            a_records(&r).unwrap(),
            [
                (Ipv4Addr::new(192, 0, 2, 1), 300),
                (Ipv4Addr::new(192, 0, 2, 2), 5)
            ]
        );
        assert_eq!(a_records(&answer(&q, &[])).unwrap(), []);
        assert_eq!(a_records(&r[..r.len() - 2]), Err(MessageError::Truncated));
    }

    #[test]
    fn refusals_echo_id_flags_and_question_only() {
        let q = query("denied.example", 1);
        let question = question(&q).unwrap();
        let r = reply_with_rcode(&q, question.end, NXDOMAIN);
        assert_eq!(&r[..2], &[0xbe, 0xef]);
        assert_eq!(r[2], 0x81, "QR and RD");
        assert_eq!(r[3], 0x80 | NXDOMAIN, "RA and NXDOMAIN");
        assert_eq!(&r[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&r[12..], &q[12..question.end]);
        let f = format_error(&q);
        assert_eq!((f.len(), f[3] & 0x0f, f[5]), (HEADER_LEN, FORMERR, 0));
    }
}
