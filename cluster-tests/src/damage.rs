//! Disk damage on a stopped node's data directory (issue 7; Jepsen lost acknowledged writes in
//! NATS to bit flips on a minority of nodes): a bit flipped inside a record of a sealed segment,
//! and the active segment of the same partition replica cut short.
//!
//! The harness drives the binary only, so it reads the segment files itself: they are Kafka
//! RecordBatch v2 concatenated (log/FORMAT.md section 2), `{base_offset:020}.log` in
//! `<data>/partitions/<group>-<replica>/log/`, the last one active. A flipped bit lands inside
//! the records section (covered by the batch crc); the damaged batch's offsets and record
//! values are kept so the checkers can tell which partition it belongs to and what must never
//! be answered from it.

use std::path::Path;
use std::path::PathBuf;

use rand::Rng as _;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use serde::Serialize;

use crate::error::Error;
use crate::error::Result;

/// Bytes of a batch header (log/FORMAT.md: `RECORD_BATCH_OVERHEAD`).
const HEADER_BYTES: usize = 61;
/// Batches of the active segment a cut removes, at most.
const CUT_BATCHES_MAX: usize = 3;

/// One batch of a segment file, from its header.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Batch {
    pub position: u64,
    pub size: u64,
    pub base_offset: u64,
    pub last_offset: u64,
}

/// The batches of a segment file's bytes, from their headers (stops at a torn tail).
pub fn batches(bytes: &[u8]) -> Vec<Batch> {
    let mut out = Vec::new();
    let mut position = 0usize;
    while let Some(head) = bytes.get(position..position + HEADER_BYTES) {
        let base_offset = u64::from_be_bytes(array(&head[0..8]));
        let length = i32::from_be_bytes(array(&head[8..12]));
        let last_delta = i32::from_be_bytes(array(&head[23..27]));
        let size = usize::try_from(length).unwrap_or(0) + 12;
        if size < HEADER_BYTES || last_delta < 0 || position + size > bytes.len() {
            break;
        }
        out.push(Batch {
            position: position as u64,
            size: size as u64,
            base_offset,
            last_offset: base_offset + last_delta as u64,
        });
        position += size;
    }
    out
}

fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[..N]);
    out
}

/// Kafka's zigzag varint at `*at`, advancing it.
fn varint(bytes: &[u8], at: &mut usize) -> Option<i64> {
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let byte = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some((value >> 1) as i64 ^ -((value & 1) as i64));
        }
    }
    None
}

/// A record's key and value (`None`: no key, or a tombstone).
pub type KeyValue = (Option<String>, Option<String>);

/// The keys and values of the records of an uncompressed batch; empty when the batch is
/// compressed or does not decode.
pub fn records(batch: &[u8]) -> Vec<KeyValue> {
    let attributes = batch.get(21..23).map_or(0, |a| i16::from_be_bytes(array(a)));
    if attributes & 0x7 != 0 || batch.len() < HEADER_BYTES {
        return Vec::new();
    }
    let count = i32::from_be_bytes(array(&batch[57..61])).max(0);
    let mut out = Vec::new();
    let mut at = HEADER_BYTES;
    for _ in 0..count {
        let Some(record) = record(batch, &mut at) else { return Vec::new() };
        out.push(record);
    }
    out
}

fn record(batch: &[u8], at: &mut usize) -> Option<KeyValue> {
    let length = usize::try_from(varint(batch, at)?).ok()?;
    let end = *at + length;
    *at += 1; // attributes
    varint(batch, at)?; // timestamp delta
    varint(batch, at)?; // offset delta
    let key = bytes_field(batch, at)?;
    let value = bytes_field(batch, at)?;
    *at = end;
    Some((key, value))
}

/// A varint length and that many bytes (`None` for length -1).
fn bytes_field(batch: &[u8], at: &mut usize) -> Option<Option<String>> {
    let length = varint(batch, at)?;
    if length < 0 {
        return Some(None);
    }
    let bytes = batch.get(*at..*at + usize::try_from(length).ok()?)?;
    *at += bytes.len();
    Some(Some(String::from_utf8_lossy(bytes).into_owned()))
}

/// A bit flipped inside a record of a sealed segment of one replica, on one node.
#[derive(Clone, Debug, Serialize)]
pub struct Damage {
    pub node: u64,
    pub file: PathBuf,
    /// The byte flipped, in the file.
    pub at: u64,
    pub batch: Batch,
    /// The keys and values of the batch's records before the flip (they name its partition).
    pub records: Vec<KeyValue>,
}

/// The active segment of that replica cut short.
#[derive(Clone, Debug, Serialize)]
pub struct Cut {
    pub file: PathBuf,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Batches wholly or partly removed.
    pub batches: usize,
    /// The replica's last checkpoint (`checkpoint.json`'s `next_offset`, raft/FORMAT.md), and
    /// whether every batch cut lies at or above it (then the replica can roll back to it; a
    /// deeper cut makes it roll back further and re-apply more, which may heal the flip).
    pub checkpoint: Option<u64>,
    pub above_checkpoint: bool,
}

/// The segment files of one partition replica: sealed ones, oldest first, then the active one.
struct ReplicaLog {
    sealed: Vec<PathBuf>,
    active: PathBuf,
    checkpoint: Option<u64>,
}

/// `next_offset` of a replica's `checkpoint.json`, if it has one.
fn checkpoint_of(replica_dir: &Path) -> Option<u64> {
    let bytes = std::fs::read(replica_dir.join("checkpoint.json")).ok()?;
    serde_json::from_slice::<serde_json::Value>(&bytes).ok()?["next_offset"].as_u64()
}

fn replica_logs(data_dir: &Path) -> Result<Vec<ReplicaLog>> {
    let root = data_dir.join("partitions");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&root).map_err(|e| Error::io(format!("listing {}", root.display()), e))? {
        let replica_dir = entry.map_err(|e| Error::io("listing partitions", e))?.path();
        let checkpoint = checkpoint_of(&replica_dir);
        let dir = replica_dir.join("log");
        let Ok(listing) = std::fs::read_dir(&dir) else { continue };
        let mut segments: Vec<PathBuf> = listing
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        segments.sort();
        if let Some(active) = segments.pop() {
            out.push(ReplicaLog { sealed: segments, active, checkpoint });
        }
    }
    out.sort_by(|a, b| a.active.cmp(&b.active));
    Ok(out)
}

/// Whether some partition replica under `data_dir` has sealed a segment yet (what
/// [`flip_and_cut`] needs), read while the node runs.
pub fn has_sealed_segment(data_dir: &Path) -> Result<bool> {
    Ok(replica_logs(data_dir)?.iter().any(|r| !r.sealed.is_empty()))
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

/// On stopped node `node`: picks a partition replica with a sealed batch and a non-empty
/// active segment, flips one bit inside a record of a random sealed batch, and cuts the
/// active segment inside one of its last batches (with `above_checkpoint`, only batches at or
/// above the replica's last checkpoint, when it has such batches). Both changes are read back.
/// `None` when no replica has both yet.
pub fn flip_and_cut(
    node: u64,
    data_dir: &Path,
    above_checkpoint: bool,
    rng: &mut StdRng,
) -> Result<Option<(Damage, Cut)>> {
    let mut candidates = Vec::new();
    for replica in replica_logs(data_dir)? {
        let mut active = batches(&read(&replica.active)?);
        let checkpoint = replica.checkpoint.unwrap_or(0);
        if above_checkpoint && active.iter().any(|b| b.base_offset >= checkpoint) {
            active.retain(|b| b.base_offset >= checkpoint);
        }
        let mut sealed = Vec::new();
        for file in &replica.sealed {
            let bytes = read(file)?;
            sealed.extend(batches(&bytes).into_iter().map(|b| (file.clone(), b)));
        }
        if !active.is_empty() && !sealed.is_empty() {
            candidates.push((replica, sealed, active));
        }
    }
    let Some((replica, sealed, active)) = candidates.choose(rng) else { return Ok(None) };
    let (file, batch) = sealed.choose(rng).ok_or_else(|| Error::Check("no sealed batch".into()))?.clone();
    let mut bytes = read(&file)?;
    let start = batch.position as usize;
    let records = records(&bytes[start..start + batch.size as usize]);
    let at = start + rng.random_range(HEADER_BYTES..batch.size as usize);
    let before = bytes[at];
    bytes[at] ^= 1 << rng.random_range(0..8);
    std::fs::write(&file, &bytes).map_err(|e| Error::io(format!("writing {}", file.display()), e))?;
    if read(&file)?.get(at) == Some(&before) {
        return Err(Error::Check(format!("the flipped byte {at} of {} did not change", file.display())));
    }
    let damage = Damage { node, file, at: at as u64, batch, records };

    let count = rng.random_range(1..=CUT_BATCHES_MAX.min(active.len()));
    let first_lost = &active[active.len() - count];
    // Inside the batch, so recovery finds a torn tail (the evidence the node logs).
    let to = first_lost.position + rng.random_range(1..first_lost.size);
    let bytes_before = std::fs::metadata(&replica.active).map_err(|e| Error::io("stat", e))?.len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&replica.active)
        .map_err(|e| Error::io(format!("opening {}", replica.active.display()), e))?;
    file.set_len(to).map_err(|e| Error::io(format!("cutting {}", replica.active.display()), e))?;
    let bytes_after = std::fs::metadata(&replica.active).map_err(|e| Error::io("stat", e))?.len();
    let above_checkpoint = replica.checkpoint.is_some_and(|c| first_lost.base_offset >= c);
    let cut = Cut {
        file: replica.active.clone(),
        bytes_before,
        bytes_after,
        batches: count,
        checkpoint: replica.checkpoint,
        above_checkpoint,
    };
    Ok(Some((damage, cut)))
}

#[cfg(test)]
mod tests {
    //! The harness's own reading of batches and records, against a hand-made batch.

    use super::*;

    fn zigzag(v: i64) -> Vec<u8> {
        let mut n = ((v << 1) ^ (v >> 63)) as u64;
        let mut out = Vec::new();
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return out;
            }
            out.push(byte | 0x80);
        }
    }

    fn record(delta: i64, key: &str, value: Option<&str>) -> Vec<u8> {
        let mut body = vec![0u8];
        body.extend(zigzag(0));
        body.extend(zigzag(delta));
        body.extend(zigzag(key.len() as i64));
        body.extend(key.as_bytes());
        match value {
            Some(v) => {
                body.extend(zigzag(v.len() as i64));
                body.extend(v.as_bytes());
            }
            None => body.extend(zigzag(-1)),
        }
        body.extend(zigzag(0));
        let mut out = zigzag(body.len() as i64);
        out.extend(body);
        out
    }

    fn batch(base: u64, records: &[Vec<u8>]) -> Vec<u8> {
        let payload: Vec<u8> = records.concat();
        let mut b = vec![0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&base.to_be_bytes());
        b[8..12].copy_from_slice(&((HEADER_BYTES + payload.len() - 12) as i32).to_be_bytes());
        b[16] = 2;
        b[23..27].copy_from_slice(&((records.len() - 1) as i32).to_be_bytes());
        b[57..61].copy_from_slice(&(records.len() as i32).to_be_bytes());
        b.extend(payload);
        b
    }

    #[test]
    fn batches_and_record_values_are_read_from_segment_bytes() {
        let one = batch(7, &[record(0, "k1", Some("v1.1")), record(1, "k2", None)]);
        let two = batch(9, &[record(0, "p", Some(&"x".repeat(200)))]);
        let mut segment = [one.clone(), two.clone()].concat();
        segment.extend_from_slice(&two[..30]); // a torn tail
        let found = batches(&segment);
        assert_eq!(found.len(), 2);
        assert_eq!((found[0].base_offset, found[0].last_offset, found[0].size), (7, 8, one.len() as u64));
        assert_eq!((found[1].position, found[1].base_offset, found[1].last_offset), (one.len() as u64, 9, 9));
        let kv = |k: &str, v: Option<&str>| (Some(k.to_string()), v.map(str::to_string));
        assert_eq!(records(&one), vec![kv("k1", Some("v1.1")), kv("k2", None)]);
        assert_eq!(records(&two), vec![kv("p", Some(&"x".repeat(200)))]);
    }
}
