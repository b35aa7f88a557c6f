//! Kafka's zigzag varints (ByteUtils.writeVarint / writeVarlong) and a
//! bounds-checked byte cursor used by the record parser.
//!
//! A varint is the zigzag transform of a signed value, written as base-128
//! little-endian groups, high bit = "more bytes follow". An `int` takes at
//! most 5 bytes, a `long` at most 10, as in Kafka.

use crate::error::{Error, Result};

const VARINT_BYTES_MAX: usize = 5;
const VARLONG_BYTES_MAX: usize = 10;

/// Appends the zigzag varint encoding of `value`.
pub(crate) fn put_varint(out: &mut Vec<u8>, value: i32) {
    put_unsigned(out, u64::from(zigzag32(value)));
}

/// Appends the zigzag varlong encoding of `value`.
pub(crate) fn put_varlong(out: &mut Vec<u8>, value: i64) {
    put_unsigned(out, zigzag64(value));
}

/// Size in bytes of `put_varint(value)`.
pub(crate) fn varint_len(value: i32) -> usize {
    unsigned_len(u64::from(zigzag32(value)))
}

/// Size in bytes of `put_varlong(value)`.
pub(crate) fn varlong_len(value: i64) -> usize {
    unsigned_len(zigzag64(value))
}

fn zigzag32(value: i32) -> u32 {
    ((value << 1) ^ (value >> 31)) as u32
}

fn zigzag64(value: i64) -> u64 {
    ((value << 1) ^ (value >> 63)) as u64
}

fn put_unsigned(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn unsigned_len(value: u64) -> usize {
    let bits = 64 - value.leading_zeros() as usize;
    bits.div_ceil(7).max(1)
}

/// A cursor over a byte slice whose reads fail with
/// [`Error::MalformedBatch`] instead of panicking. `base` is added to
/// positions in errors so they point into the enclosing buffer.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    base: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8], base: usize) -> Cursor<'a> {
        Cursor { bytes, pos: 0, base }
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// The whole slice this cursor walks.
    pub(crate) fn whole(&self) -> &'a [u8] {
        self.bytes
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub(crate) fn error(&self, reason: &'static str) -> Error {
        Error::malformed(reason, self.base + self.pos)
    }

    pub(crate) fn u8(&mut self) -> Result<u8> {
        let byte = *self.bytes.get(self.pos).ok_or_else(|| self.error("truncated record"))?;
        self.pos += 1;
        Ok(byte)
    }

    pub(crate) fn bytes(&mut self, len: usize) -> Result<&'a [u8]> {
        if len > self.remaining() {
            return Err(self.error("field length exceeds record"));
        }
        let slice = &self.bytes[self.pos..self.pos + len];
        self.pos += len;
        Ok(slice)
    }

    pub(crate) fn varint(&mut self) -> Result<i32> {
        let raw = self.unsigned(VARINT_BYTES_MAX, "varint longer than 5 bytes")? as u32;
        Ok(((raw >> 1) as i32) ^ -((raw & 1) as i32))
    }

    pub(crate) fn varlong(&mut self) -> Result<i64> {
        let raw = self.unsigned(VARLONG_BYTES_MAX, "varlong longer than 10 bytes")?;
        Ok(((raw >> 1) as i64) ^ -((raw & 1) as i64))
    }

    /// A length-prefixed byte field: -1 is null, other negatives are errors.
    pub(crate) fn nullable_bytes(&mut self) -> Result<Option<&'a [u8]>> {
        match self.varint()? {
            -1 => Ok(None),
            len if len < 0 => Err(self.error("negative field length")),
            len => self.bytes(len as usize).map(Some),
        }
    }

    fn unsigned(&mut self, bytes_max: usize, too_long: &'static str) -> Result<u64> {
        let mut value = 0u64;
        for i in 0..bytes_max {
            let byte = self.u8().map_err(|_| self.error("truncated varint"))?;
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.error(too_long))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_match_encodings() {
        for v in [0, 1, -1, 63, -64, 64, -65, 8191, 8192, i32::MAX, i32::MIN] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), varint_len(v), "{v}");
            assert_eq!(Cursor::new(&out, 0).varint().ok(), Some(v));
        }
        for v in [0, 1, -1, i64::MAX, i64::MIN, 1 << 40, -(1 << 40)] {
            let mut out = Vec::new();
            put_varlong(&mut out, v);
            assert_eq!(out.len(), varlong_len(v), "{v}");
            assert_eq!(Cursor::new(&out, 0).varlong().ok(), Some(v));
        }
    }

    /// Vectors of Kafka's `ByteUtilsTest.testVarintSerde` / `testVarlongSerde`.
    #[test]
    fn kafka_byte_utils_vectors() {
        let varints: &[(i32, &[u8])] = &[
            (0, &[0x00]),
            (-1, &[0x01]),
            (1, &[0x02]),
            (63, &[0x7e]),
            (-64, &[0x7f]),
            (64, &[0x80, 0x01]),
            (-65, &[0x81, 0x01]),
            (8191, &[0xfe, 0x7f]),
            (-8192, &[0xff, 0x7f]),
            (8192, &[0x80, 0x80, 0x01]),
            (-8193, &[0x81, 0x80, 0x01]),
            (1048575, &[0xfe, 0xff, 0x7f]),
            (-1048576, &[0xff, 0xff, 0x7f]),
            (1048576, &[0x80, 0x80, 0x80, 0x01]),
            (-1048577, &[0x81, 0x80, 0x80, 0x01]),
            (134217727, &[0xfe, 0xff, 0xff, 0x7f]),
            (-134217728, &[0xff, 0xff, 0xff, 0x7f]),
            (134217728, &[0x80, 0x80, 0x80, 0x80, 0x01]),
            (-134217729, &[0x81, 0x80, 0x80, 0x80, 0x01]),
            (i32::MAX, &[0xfe, 0xff, 0xff, 0xff, 0x0f]),
            (i32::MIN, &[0xff, 0xff, 0xff, 0xff, 0x0f]),
        ];
        for &(value, bytes) in varints {
            let mut out = Vec::new();
            put_varint(&mut out, value);
            assert_eq!(out, bytes, "varint {value}");
            assert_eq!(Cursor::new(bytes, 0).varint().ok(), Some(value));
            let mut out = Vec::new();
            put_varlong(&mut out, i64::from(value));
            assert_eq!(out, bytes, "varlong {value}");
        }
        let varlongs: &[(i64, &[u8])] = &[
            (17179869183, &[0xfe, 0xff, 0xff, 0xff, 0x7f]),
            (-17179869184, &[0xff, 0xff, 0xff, 0xff, 0x7f]),
            (17179869184, &[0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (-17179869185, &[0x81, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (2199023255551, &[0xfe, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (-2199023255552, &[0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (2199023255552, &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (-2199023255553, &[0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (281474976710655, &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (-281474976710656, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (281474976710656, &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (-281474976710657, &[0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (36028797018963967, &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (-36028797018963968, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (36028797018963968, &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (-36028797018963969, &[0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (4611686018427387903, &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (-4611686018427387904, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            (4611686018427387904, &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (-4611686018427387905, &[0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]),
            (i64::MAX, &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
            (i64::MIN, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
        ];
        for &(value, bytes) in varlongs {
            let mut out = Vec::new();
            put_varlong(&mut out, value);
            assert_eq!(out, bytes, "varlong {value}");
            assert_eq!(Cursor::new(bytes, 0).varlong().ok(), Some(value));
        }
    }

    /// Kafka's `testInvalidVarint` / `testInvalidVarlong`: one overflow byte.
    #[test]
    fn overlong_varints_are_errors() {
        assert!(Cursor::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x01], 0).varint().is_err());
        assert!(Cursor::new(&[0xff; 11], 0).varlong().is_err());
        assert!(Cursor::new(&[0x80], 0).varint().is_err());
    }
}
