//! A property test of `Log` against an in-memory model: random appends,
//! reads, rolls, truncations, resets, retention, compaction and reopens;
//! after each step the log must answer exactly like the model.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use logdex_log::{Compression, Log, LogConfig, Offset, Record, decode_batch, encode_batch, validate_batch};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct RecordSpec {
    key: Option<u8>,
    tombstone: bool,
    value_len: u8,
}

#[derive(Clone, Debug)]
enum Op {
    Append(Vec<RecordSpec>, Compression),
    ReadRecord(u16),
    ReadRecords(u16, u8, u16),
    ReadBatches(u16, u16),
    Roll,
    Truncate(u16),
    Reset(u8),
    RetentionBytes(u8),
    RetentionMs(u16),
    Compact(u16),
    Reopen,
}

fn codec() -> impl Strategy<Value = Compression> {
    prop_oneof![Just(Compression::None), Just(Compression::Lz4), Just(Compression::Zstd)]
}

fn record_spec() -> impl Strategy<Value = RecordSpec> {
    (proptest::option::weighted(0.9, 0u8..8), proptest::bool::weighted(0.15), 0u8..60)
        .prop_map(|(key, tombstone, value_len)| RecordSpec { key, tombstone, value_len })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (proptest::collection::vec(record_spec(), 1..6), codec()).prop_map(|(r, c)| Op::Append(r, c)),
        3 => any::<u16>().prop_map(Op::ReadRecord),
        2 => (any::<u16>(), 1u8..20, 1u16..2000).prop_map(|(o, n, b)| Op::ReadRecords(o, n, b)),
        2 => (any::<u16>(), 0u16..2000).prop_map(|(o, b)| Op::ReadBatches(o, b)),
        1 => Just(Op::Roll),
        1 => any::<u16>().prop_map(Op::Truncate),
        1 => (0u8..3).prop_map(Op::Reset),
        1 => any::<u8>().prop_map(Op::RetentionBytes),
        1 => (0u16..400).prop_map(Op::RetentionMs),
        2 => (0u16..400).prop_map(Op::Compact),
        1 => Just(Op::Reopen),
    ]
}

fn config() -> LogConfig {
    LogConfig { segment_bytes: 1024, seek_interval_bytes: 128, ..LogConfig::default() }
}

/// What the log must contain.
struct Model {
    records: BTreeMap<Offset, Record>,
    batch_bases: Vec<Offset>,
    start: Offset,
    next: Offset,
    clock_ms: i64,
}

impl Model {
    fn record(&mut self, spec: &RecordSpec) -> Record {
        self.clock_ms += 1;
        Record {
            timestamp_ms: self.clock_ms,
            key: spec.key.map(|k| vec![b'k', k]),
            value: (!spec.tombstone || spec.key.is_none()).then(|| vec![spec.value_len; spec.value_len as usize]),
            headers: Vec::new(),
        }
    }

    /// The key index: latest present record per key, absent when a tombstone.
    fn index(&self) -> HashMap<Vec<u8>, Offset> {
        let mut index = HashMap::new();
        for (offset, record) in &self.records {
            if let Some(key) = &record.key {
                match record.value {
                    Some(_) => index.insert(key.clone(), *offset),
                    None => index.remove(key),
                };
            }
        }
        index
    }

    /// Picks an offset in `[start - 1, next + 1]` from a random number.
    fn pick(&self, raw: u16) -> Offset {
        let low = self.start.saturating_sub(1);
        low + u64::from(raw) % (self.next + 2 - low)
    }
}

type TestResult = Result<(), TestCaseError>;

fn check<T, E: std::fmt::Debug>(result: Result<T, E>) -> Result<T, TestCaseError> {
    result.map_err(|e| TestCaseError::fail(format!("{e:?}")))
}

fn apply(log: &mut Log, model: &mut Model, dir: &Path, op: &Op) -> TestResult {
    match op {
        Op::Append(specs, codec) => {
            let records: Vec<Record> = specs.iter().map(|s| model.record(s)).collect();
            let mut batch = check(encode_batch(&records, *codec))?;
            let info = check(log.append(&mut batch, model.clock_ms as u64))?;
            prop_assert_eq!(info.base_offset, model.next);
            model.batch_bases.push(model.next);
            for record in records {
                model.records.insert(model.next, record);
                model.next += 1;
            }
        }
        Op::ReadRecord(raw) => check_read_record(log, model, model.pick(*raw))?,
        Op::ReadRecords(raw, max_records, max_bytes) => {
            check_read_records(log, model, model.pick(*raw), *max_records as usize, *max_bytes as usize)?
        }
        Op::ReadBatches(raw, max_bytes) => check_read_batches(log, model, model.pick(*raw), *max_bytes as usize)?,
        Op::Roll => check(log.roll())?,
        Op::Truncate(raw) => truncate(log, model, *raw)?,
        Op::Reset(delta) => {
            let start = model.next + u64::from(*delta);
            check(log.reset(start))?;
            model.records.clear();
            model.batch_bases.clear();
            (model.start, model.next) = (start, start);
        }
        Op::RetentionBytes(fraction) => {
            let limit = log.size_bytes() * u64::from(*fraction) / 255;
            retention(log, model, None, Some(limit))?;
        }
        Op::RetentionMs(ms) => retention(log, model, Some(u64::from(*ms)), None)?,
        Op::Compact(age) => compact(log, model, model.clock_ms - i64::from(*age))?,
        Op::Reopen => {
            *log = check(Log::open(dir, config()))?;
        }
    }
    prop_assert_eq!((log.start_offset(), log.next_offset()), (model.start, model.next));
    Ok(())
}

fn check_read_record(log: &Log, model: &Model, offset: Offset) -> TestResult {
    let expected = model.records.get(&offset).map(|r| (offset, r.clone()));
    prop_assert_eq!(check(log.read_record(offset))?, expected);
    Ok(())
}

fn check_read_records(log: &Log, model: &Model, offset: Offset, max_records: usize, max_bytes: usize) -> TestResult {
    let result = log.read_records(offset, max_records, max_bytes);
    if offset < model.start {
        prop_assert!(result.is_err());
        return Ok(());
    }
    let got = check(result)?;
    let expected: Vec<(Offset, Record)> =
        model.records.range(offset..).take(got.len()).map(|(o, r)| (*o, r.clone())).collect();
    prop_assert_eq!(&got, &expected);
    prop_assert!(got.len() <= max_records);
    prop_assert!(!got.is_empty() || model.records.range(offset..).next().is_none());
    Ok(())
}

fn check_read_batches(log: &Log, model: &Model, offset: Offset, max_bytes: usize) -> TestResult {
    let result = log.read_batches(offset, max_bytes);
    if offset < model.start {
        prop_assert!(result.is_err());
        return Ok(());
    }
    let bytes = check(result)?;
    let mut position = 0;
    let mut decoded = Vec::new();
    while position < bytes.len() {
        let length =
            i32::from_be_bytes([bytes[position + 8], bytes[position + 9], bytes[position + 10], bytes[position + 11]]);
        let end = position + length as usize + 12;
        let info = check(validate_batch(&bytes[position..end]))?;
        if position == 0 {
            prop_assert!(info.last_offset >= offset);
        }
        decoded.extend(check(decode_batch(&bytes[position..end]))?);
        position = end;
    }
    let got: Vec<(Offset, Record)> = decoded.into_iter().filter(|(o, _)| *o >= offset).collect();
    let expected: Vec<(Offset, Record)> =
        model.records.range(offset..).take(got.len()).map(|(o, r)| (*o, r.clone())).collect();
    prop_assert_eq!(&got, &expected);
    prop_assert!(!bytes.is_empty() || model.records.range(offset..).next().is_none());
    Ok(())
}

fn truncate(log: &mut Log, model: &mut Model, raw: u16) -> TestResult {
    let candidates: Vec<Offset> = model.batch_bases.iter().copied().filter(|b| *b >= model.start).collect();
    let Some(&at) = candidates.get(raw as usize % candidates.len().max(1)) else {
        return Ok(());
    };
    check(log.truncate(at))?;
    model.records.split_off(&at);
    model.batch_bases.retain(|b| *b < at);
    model.next = at;
    Ok(())
}

fn retention(log: &mut Log, model: &mut Model, ms: Option<u64>, bytes: Option<u64>) -> TestResult {
    let segments = log.segments();
    let mut total: u64 = segments.iter().map(|s| s.size_bytes).sum();
    let mut expected_start = model.start;
    // Oldest first, the active segment too when it holds records (then the log is left empty
    // at its next offset).
    for (i, segment) in segments.iter().enumerate() {
        let next = segments.get(i + 1);
        if next.is_none() && segment.size_bytes == 0 {
            break;
        }
        let max_ts = model.records.range(segment.base_offset..segment.next_offset).map(|(_, r)| r.timestamp_ms).max();
        let big = bytes.is_some_and(|limit| total - segment.size_bytes >= limit);
        // A segment compaction emptied goes by time only with the next one past retention.
        if segment.size_bytes == 0 && !big {
            continue;
        }
        let old = ms.is_some_and(|ms| model.clock_ms.saturating_sub(max_ts.unwrap_or(i64::MIN)) > ms as i64);
        if !(old || big) {
            break;
        }
        total -= segment.size_bytes;
        expected_start = next.map_or(model.next, |n| n.base_offset);
    }
    check(log.set_config(LogConfig { retention_ms: ms, retention_bytes: bytes, ..config() }))?;
    prop_assert_eq!(check(log.apply_retention(model.clock_ms as u64))?, expected_start);
    check(log.set_config(config()))?;
    model.start = expected_start;
    model.records = model.records.split_off(&expected_start);
    Ok(())
}

fn compact(log: &mut Log, model: &mut Model, horizon: i64) -> TestResult {
    let sealed_end = log.segments().last().map_or(0, |s| s.base_offset);
    let index = model.index();
    let mut live = |key: &[u8], offset: Offset| index.get(key) == Some(&offset);
    let stats = check(log.compact(&mut live, horizon))?;
    let before = model.records.len();
    model.records.retain(|offset, record| {
        *offset >= sealed_end
            || match (&record.key, &record.value) {
                (None, _) => true,
                (Some(_), None) => record.timestamp_ms >= horizon,
                (Some(key), Some(_)) => index.get(key) == Some(offset),
            }
    });
    prop_assert_eq!(stats.records_removed, (before - model.records.len()) as u64);
    Ok(())
}

fn check_everything(log: &Log, model: &Model) -> TestResult {
    let scanned: Vec<(Offset, Record)> = check(log.scan(0).collect::<Result<Vec<_>, _>>())?;
    let expected: Vec<(Offset, Record)> = model.records.iter().map(|(o, r)| (*o, r.clone())).collect();
    prop_assert_eq!(scanned, expected);
    for offset in model.start.saturating_sub(1)..model.next + 1 {
        check_read_record(log, model, offset)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The log answers every read exactly like the model after any sequence of operations.
    #[test]
    fn log_matches_model(ops in proptest::collection::vec(op(), 10..80)) {
        let dir = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut log = check(Log::open(dir.path(), config()))?;
        let mut model = Model { records: BTreeMap::new(), batch_bases: Vec::new(), start: 0, next: 0, clock_ms: 0 };
        for op in &ops {
            apply(&mut log, &mut model, dir.path(), op)?;
            if matches!(op, Op::Compact(_) | Op::Truncate(_) | Op::Reopen | Op::RetentionBytes(_) | Op::RetentionMs(_)) {
                check_everything(&log, &model)?;
            }
        }
        check_everything(&log, &model)?;
        drop(log);
        let reopened = check(Log::open(dir.path(), config()))?;
        check_everything(&reopened, &model)?;
    }
}
