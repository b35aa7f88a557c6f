//! What a client knows about the writes it sent, and the checks that no acknowledged write is
//! lost (DESIGN.md invariant I2) and that nothing unwritten appears.
//!
//! Every written value is unique, so a value read back names the write that produced it. A
//! write attempt that got no 200 may or may not have taken effect; only a 200 is an
//! acknowledgement.

use std::collections::BTreeMap;
use std::collections::HashSet;

use crate::client::FetchResponse;
use crate::client::HEADER_OFFSET;
use crate::client::Reply;
use crate::client::Written;
use crate::error::Error;
use crate::error::Result;

/// A partition's records by offset: `(key, value)`, `None` value for a tombstone.
pub type PartitionLog = BTreeMap<u64, (Option<Vec<u8>>, Option<Vec<u8>>)>;

/// The client's knowledge about one key.
#[derive(Clone, Debug, Default)]
pub struct KeyHistory {
    /// The partition reported by acknowledgements of this key.
    pub partition: Option<u32>,
    /// The last acknowledged value and its offset.
    pub last_ack: Option<(Vec<u8>, u64)>,
    /// Values sent at least once (they may have taken effect, acknowledged or not).
    pub attempted: HashSet<Vec<u8>>,
    /// Values that were acknowledged.
    pub acked: HashSet<Vec<u8>>,
}

/// One acknowledged write.
#[derive(Clone, Debug)]
pub struct Ack {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub written: Written,
}

/// Every write a client sent, in the order it sent them (writes to one key are sequential).
#[derive(Clone, Debug, Default)]
pub struct History {
    keys: BTreeMap<Vec<u8>, KeyHistory>,
    acks: Vec<Ack>,
    attempts: u64,
}

impl History {
    /// Records that a write of `value` to `key` is about to be sent.
    pub fn attempt(&mut self, key: &[u8], value: &[u8]) {
        self.attempts += 1;
        self.keys.entry(key.to_vec()).or_default().attempted.insert(value.to_vec());
    }

    /// Records a 200 for a write of `value` to `key`.
    pub fn ack(&mut self, key: &[u8], value: &[u8], written: Written) {
        let entry = self.keys.entry(key.to_vec()).or_default();
        entry.partition = Some(written.partition);
        entry.last_ack = Some((value.to_vec(), written.offset));
        entry.acked.insert(value.to_vec());
        self.acks.push(Ack { key: key.to_vec(), value: value.to_vec(), written });
    }

    pub fn acks(&self) -> &[Ack] {
        &self.acks
    }

    pub fn attempts(&self) -> u64 {
        self.attempts
    }

    pub fn keys(&self) -> impl Iterator<Item = (&Vec<u8>, &KeyHistory)> {
        self.keys.iter()
    }

    /// Checks a lookup of `key` against what the client knows:
    /// - after an acknowledged write, the answer is 200 at an offset at or after it;
    /// - at that very offset, the value is the acknowledged one;
    /// - at a later offset, the value is one that was sent but never acknowledged (an attempt
    ///   whose outcome the client could not know);
    /// - with no acknowledged write, the answer is 404 or one of the sent values.
    ///
    /// Returns the offset of the answer (`None` for 404).
    pub fn check_lookup(&self, key: &[u8], reply: &Reply) -> Result<Option<u64>> {
        let fail = |what: String| Err(Error::Check(format!("key {:?}: {what}; {}", show(key), reply.summary())));
        let Some(known) = self.keys.get(key) else {
            return fail("the test never wrote this key".into());
        };
        if reply.status == 404 {
            return match &known.last_ack {
                None => Ok(None),
                Some((value, offset)) => fail(format!(
                    "acknowledged write lost: expected value {:?} at offset {offset}, got 404",
                    show(value)
                )),
            };
        }
        if reply.status != 200 {
            return fail("expected 200 or 404".into());
        }
        let offset = reply.header_u64(HEADER_OFFSET)?;
        let value = &reply.body;
        match &known.last_ack {
            Some((acked, acked_offset)) if offset < *acked_offset => fail(format!(
                "acknowledged write lost: expected value {:?} at offset {acked_offset}, read offset {offset}",
                show(acked)
            )),
            Some((acked, acked_offset)) if offset == *acked_offset && value != acked => {
                fail(format!("offset {offset} was acknowledged for value {:?}, read {:?}", show(acked), show(value)))
            }
            Some((_, acked_offset)) if offset > *acked_offset && !known.attempted.contains(value) => {
                fail(format!("read {:?}, a value never written to this key", show(value)))
            }
            Some((_, acked_offset)) if offset > *acked_offset && known.acked.contains(value) => fail(format!(
                "a value acknowledged earlier ({:?}) reappeared at offset {offset}, after the last \
                 acknowledged write at {acked_offset}",
                show(value)
            )),
            None if !known.attempted.contains(value) => fail(format!("read {:?}, a value never written", show(value))),
            _ => Ok(Some(offset)),
        }
    }

    /// Checks that fetched records of `partition` (offset -> key, value) hold every
    /// acknowledged write of that partition at its acknowledged offset; returns the failures.
    pub fn check_log(&self, partition: u32, log: &PartitionLog) -> Vec<String> {
        let mut failures = Vec::new();
        for ack in self.acks.iter().filter(|a| a.written.partition == partition) {
            let offset = ack.written.offset;
            match log.get(&offset) {
                Some((Some(key), Some(value))) if *key == ack.key && *value == ack.value => {}
                other => failures.push(format!(
                    "partition {partition} offset {offset}: acknowledged key {:?} value {:?}, log has {:?}",
                    show(&ack.key),
                    show(&ack.value),
                    other.map(|(k, v)| (k.as_deref().map(show), v.as_deref().map(show)))
                )),
            }
        }
        failures
    }
}

/// Appends the records of one fetch page to `log`, decoding keys and values.
pub fn collect_fetched(page: &FetchResponse, log: &mut PartitionLog) -> Result<()> {
    for record in &page.records {
        log.insert(record.offset, (page.bytes_of(&record.key)?, page.bytes_of(&record.value)?));
    }
    Ok(())
}

/// Bytes shown as text when they are UTF-8, else as a byte list.
pub fn show(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => format!("{bytes:?}"),
    }
}

#[cfg(test)]
mod tests {
    use reqwest::header::HeaderMap;
    use reqwest::header::HeaderValue;

    use super::History;
    use crate::client::HEADER_OFFSET;
    use crate::client::Reply;
    use crate::client::Written;

    fn lookup(status: u16, offset: Option<u64>, body: &[u8]) -> Reply {
        let mut headers = HeaderMap::new();
        if let Some(offset) = offset {
            headers.insert(HEADER_OFFSET, HeaderValue::from(offset));
        }
        Reply { method: "GET".into(), url: "test".into(), status, headers, body: body.to_vec() }
    }

    /// k: v1 acknowledged at 3, v2 acknowledged at 7, v3 sent without an answer.
    fn history() -> History {
        let mut h = History::default();
        for (value, offset) in [(&b"v1"[..], 3), (b"v2", 7)] {
            h.attempt(b"k", value);
            h.ack(b"k", value, Written { partition: 0, offset });
        }
        h.attempt(b"k", b"v3");
        h
    }

    /// The last acknowledged value, or a later unacknowledged one, passes; anything else fails.
    #[test]
    fn check_lookup_accepts_only_the_last_ack_or_a_later_unacknowledged_write() {
        let h = history();
        assert_eq!(h.check_lookup(b"k", &lookup(200, Some(7), b"v2")).ok(), Some(Some(7)));
        assert!(h.check_lookup(b"k", &lookup(200, Some(9), b"v3")).is_ok());
        assert!(h.check_lookup(b"k", &lookup(404, None, b"")).is_err(), "a lost ack is a 404");
        assert!(h.check_lookup(b"k", &lookup(200, Some(3), b"v1")).is_err(), "an older ack is a lost ack");
        assert!(h.check_lookup(b"k", &lookup(200, Some(7), b"v3")).is_err(), "the acked offset holds the acked value");
        assert!(h.check_lookup(b"k", &lookup(200, Some(9), b"v1")).is_err(), "an acked value cannot come back later");
        assert!(h.check_lookup(b"k", &lookup(200, Some(9), b"v9")).is_err(), "a value never written");
        assert!(h.check_lookup(b"k", &lookup(200, None, b"v2")).is_err(), "X-Kv-Offset is required");
        assert!(h.check_lookup(b"other", &lookup(404, None, b"")).is_err(), "a key the test never wrote");
    }

    /// Without any acknowledgement, absence or a sent value passes.
    #[test]
    fn check_lookup_without_ack_accepts_absence_or_a_sent_value() {
        let mut h = History::default();
        h.attempt(b"k", b"v1");
        assert!(h.check_lookup(b"k", &lookup(404, None, b"")).is_ok());
        assert!(h.check_lookup(b"k", &lookup(200, Some(0), b"v1")).is_ok());
        assert!(h.check_lookup(b"k", &lookup(200, Some(0), b"v2")).is_err());
    }
}
