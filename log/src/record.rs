//! One record inside a batch's records section, as Kafka's `DefaultRecord`:
//!
//! ```text
//! length: varint            (bytes after this field)
//! attributes: int8          (unused, 0)
//! timestampDelta: varlong
//! offsetDelta: varint
//! keyLength: varint         (-1 = null)   key: bytes
//! valueLength: varint       (-1 = null)   value: bytes
//! headerCount: varint
//!   headerKeyLength: varint  headerKey: UTF-8 bytes
//!   headerValueLength: varint (-1 = null)  headerValue: bytes
//! ```
//!
//! [`RecordView`] parses a record without allocating; reads convert only the
//! records they return.

use crate::batch::{BatchHeader, Header, Record};
use crate::error::{Error, Result};
use crate::varint::{Cursor, put_varint, put_varlong, varint_len, varlong_len};

/// Smallest possible record: a 1-byte length and six 1-byte fields.
pub(crate) const RECORD_BYTES_MIN: usize = 7;

/// Smallest possible header: two 1-byte lengths.
const HEADER_BYTES_MIN: usize = 2;

/// A parsed, validated record borrowing its bytes from the records section.
pub(crate) struct RecordView<'a> {
    pub offset_delta: i32,
    pub timestamp_delta: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    headers: &'a [u8],
    header_count: usize,
    headers_at: usize,
}

impl<'a> RecordView<'a> {
    /// Converts to an owned record with the given absolute timestamp.
    pub(crate) fn to_record(&self, timestamp_ms: i64) -> Result<Record> {
        Ok(Record {
            timestamp_ms,
            key: self.key.map(<[u8]>::to_vec),
            value: self.value.map(<[u8]>::to_vec),
            headers: self.headers()?,
        })
    }

    fn headers(&self) -> Result<Vec<Header>> {
        let mut cursor = Cursor::new(self.headers, self.headers_at);
        let mut headers = Vec::with_capacity(self.header_count);
        for _ in 0..self.header_count {
            let (key, value) = parse_header(&mut cursor)?;
            headers.push(Header { key: key.to_owned(), value: value.map(<[u8]>::to_vec) });
        }
        Ok(headers)
    }

    fn parse(cursor: &mut Cursor<'a>, at: usize) -> Result<RecordView<'a>> {
        let length = cursor.varint()?;
        if length < 0 {
            return Err(cursor.error("negative record length"));
        }
        let body_at = at + cursor.position();
        let body = cursor.bytes(length as usize)?;
        let mut body = Cursor::new(body, body_at);
        let _attributes = body.u8()?;
        let timestamp_delta = body.varlong()?;
        let offset_delta = body.varint()?;
        let key = body.nullable_bytes()?;
        let value = body.nullable_bytes()?;
        let header_count = body.varint()?;
        if header_count < 0 || header_count as usize > body.remaining() / HEADER_BYTES_MIN {
            return Err(body.error("invalid header count"));
        }
        let headers_start = body.position();
        let headers_at = body_at + headers_start;
        for _ in 0..header_count {
            parse_header(&mut body)?;
        }
        if body.remaining() != 0 {
            return Err(body.error("record length does not match its fields"));
        }
        let headers = &body.whole()[headers_start..];
        Ok(RecordView {
            offset_delta,
            timestamp_delta,
            key,
            value,
            headers,
            header_count: header_count as usize,
            headers_at,
        })
    }
}

fn parse_header<'a>(cursor: &mut Cursor<'a>) -> Result<(&'a str, Option<&'a [u8]>)> {
    let key_len = cursor.varint()?;
    if key_len < 0 {
        return Err(cursor.error("null or negative header key length"));
    }
    let key_at = cursor.position();
    let key = cursor.bytes(key_len as usize)?;
    let key = std::str::from_utf8(key).map_err(|_| Error::malformed("header key is not UTF-8", key_at))?;
    let value = cursor.nullable_bytes()?;
    Ok((key, value))
}

/// Iterates the records of a records section, checking the record count,
/// that offset deltas strictly increase within `0..=last_offset_delta`, and
/// that no bytes follow the last record.
pub(crate) struct RecordIter<'a> {
    cursor: Cursor<'a>,
    at: usize,
    remaining: i32,
    previous_delta: i64,
    last_offset_delta: i32,
    done: bool,
}

impl<'a> RecordIter<'a> {
    pub(crate) fn new(header: &BatchHeader, payload: &'a [u8], at: usize) -> RecordIter<'a> {
        RecordIter {
            cursor: Cursor::new(payload, at),
            at,
            remaining: header.record_count,
            previous_delta: -1,
            last_offset_delta: header.last_offset_delta,
            done: false,
        }
    }

    fn next_view(&mut self) -> Result<Option<RecordView<'a>>> {
        if self.remaining == 0 {
            if self.cursor.remaining() != 0 {
                return Err(self.cursor.error("bytes after the last record"));
            }
            return Ok(None);
        }
        let view = RecordView::parse(&mut self.cursor, self.at)?;
        let delta = i64::from(view.offset_delta);
        if delta <= self.previous_delta || delta > i64::from(self.last_offset_delta) {
            return Err(self.cursor.error("record offset delta out of order or beyond the batch"));
        }
        self.previous_delta = delta;
        self.remaining -= 1;
        Ok(Some(view))
    }
}

impl<'a> Iterator for RecordIter<'a> {
    type Item = Result<RecordView<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let item = self.next_view().transpose();
        if !matches!(item, Some(Ok(_))) {
            self.done = true;
        }
        item
    }
}

/// Appends one encoded record.
pub(crate) fn put_record(out: &mut Vec<u8>, offset_delta: i32, timestamp_delta: i64, record: &Record) -> Result<()> {
    let body_len = body_len(offset_delta, timestamp_delta, record)?;
    out.reserve(body_len + 5);
    put_varint(out, body_len as i32);
    out.push(0);
    put_varlong(out, timestamp_delta);
    put_varint(out, offset_delta);
    put_nullable(out, record.key.as_deref());
    put_nullable(out, record.value.as_deref());
    put_varint(out, record.headers.len() as i32);
    for header in &record.headers {
        put_varint(out, header.key.len() as i32);
        out.extend_from_slice(header.key.as_bytes());
        put_nullable(out, header.value.as_deref());
    }
    Ok(())
}

fn put_nullable(out: &mut Vec<u8>, bytes: Option<&[u8]>) {
    match bytes {
        None => put_varint(out, -1),
        Some(bytes) => {
            put_varint(out, bytes.len() as i32);
            out.extend_from_slice(bytes);
        }
    }
}

/// Size of the record after its length field; every length must fit i32.
fn body_len(offset_delta: i32, timestamp_delta: i64, record: &Record) -> Result<usize> {
    let mut len = 1 + varlong_len(timestamp_delta) + varint_len(offset_delta);
    len += nullable_len(record.key.as_deref())? + nullable_len(record.value.as_deref())?;
    len += varint_len(len_i32(record.headers.len())?);
    for header in &record.headers {
        len += varint_len(len_i32(header.key.len())?) + header.key.len();
        len += nullable_len(header.value.as_deref())?;
    }
    len_i32(len)?;
    Ok(len)
}

fn nullable_len(bytes: Option<&[u8]>) -> Result<usize> {
    match bytes {
        None => Ok(1),
        Some(bytes) => Ok(varint_len(len_i32(bytes.len())?) + bytes.len()),
    }
}

fn len_i32(len: usize) -> Result<i32> {
    i32::try_from(len).map_err(|_| Error::BatchTooLarge { size: len, limit: i32::MAX as usize })
}
