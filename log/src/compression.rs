//! Records-section codecs: none, lz4 (LZ4 frame format, as Kafka's
//! `Lz4BlockOutputStream`) and zstd (one zstd frame, as zstd-jni's stream).
//! Decompression is bounded by [`DECOMPRESSED_BYTES_MAX`].

use std::cell::RefCell;
use std::io::Read;

use lz4_flex::frame::{BlockMode, BlockSize, FrameDecoder, FrameEncoder, FrameInfo};

use crate::batch::Compression;
use crate::error::{Error, Result};

/// Largest decompressed records section accepted (64 MiB).
pub const DECOMPRESSED_BYTES_MAX: usize = 64 << 20;

/// zstd level used by Kafka's producer by default.
const ZSTD_LEVEL: i32 = 3;

/// log2 of the largest zstd window accepted; a window never needs to exceed
/// the decompressed size bound.
const ZSTD_WINDOW_LOG_MAX: u32 = 26;

const _: () = assert!(1usize << ZSTD_WINDOW_LOG_MAX == DECOMPRESSED_BYTES_MAX);

/// Compresses a records section. `Compression::None` is not a codec here.
pub(crate) fn compress(codec: Compression, payload: &[u8]) -> Result<Vec<u8>> {
    let failed = |source| Error::Decompress { codec, source };
    match codec {
        Compression::None => Ok(payload.to_vec()),
        Compression::Lz4 => {
            // Kafka's reader decompresses every block on its own: blocks must
            // be independent. 64 KiB blocks, no checksums (the batch crc
            // covers the bytes), as Kafka's writer.
            let info = FrameInfo::new().block_size(BlockSize::Max64KB).block_mode(BlockMode::Independent);
            let mut encoder = FrameEncoder::with_frame_info(info, Vec::new());
            std::io::Write::write_all(&mut encoder, payload).map_err(failed)?;
            encoder.finish().map_err(|e| failed(std::io::Error::other(e)))
        }
        Compression::Zstd => zstd::bulk::compress(payload, ZSTD_LEVEL).map_err(failed),
    }
}

/// Decompresses `input` into `out` (cleared first), refusing more than
/// [`DECOMPRESSED_BYTES_MAX`] bytes.
pub(crate) fn decompress(codec: Compression, input: &[u8], out: &mut Vec<u8>) -> Result<()> {
    out.clear();
    let failed = |source| Error::Decompress { codec, source };
    let limit = DECOMPRESSED_BYTES_MAX as u64 + 1;
    match codec {
        Compression::None => out.extend_from_slice(input),
        Compression::Lz4 => {
            let decoder = FrameDecoder::new(input);
            decoder.take(limit).read_to_end(out).map_err(failed)?;
        }
        Compression::Zstd => {
            if !zstd_bulk(input, out) {
                out.clear();
                let mut decoder = zstd::stream::read::Decoder::with_buffer(input).map_err(failed)?;
                decoder.window_log_max(ZSTD_WINDOW_LOG_MAX).map_err(failed)?;
                decoder.take(limit).read_to_end(out).map_err(failed)?;
            }
        }
    }
    if out.len() > DECOMPRESSED_BYTES_MAX {
        return Err(Error::DecompressedTooLarge { limit: DECOMPRESSED_BYTES_MAX });
    }
    Ok(())
}

thread_local! {
    /// One reusable zstd context per thread: creating one per batch costs
    /// more than decompressing a small batch.
    static ZSTD_CONTEXT: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// Fast path for a frame that declares its content size (as our encoder
/// writes): one call into a cached context. Returns false when the frame
/// does not declare a size within the bound or anything fails; the caller
/// then takes the streaming path, which gives the authoritative answer.
fn zstd_bulk(input: &[u8], out: &mut Vec<u8>) -> bool {
    let Ok(Some(size)) = zstd::zstd_safe::get_frame_content_size(input) else {
        return false;
    };
    if size > DECOMPRESSED_BYTES_MAX as u64 {
        return false;
    }
    ZSTD_CONTEXT.with(|cell| {
        let Ok(mut slot) = cell.try_borrow_mut() else {
            return false;
        };
        if slot.is_none() {
            *slot = zstd::bulk::Decompressor::new().ok();
        }
        let Some(context) = slot.as_mut() else {
            return false;
        };
        out.clear();
        out.reserve(size as usize);
        matches!(context.decompress_to_buffer(input, out), Ok(n) if n as u64 == size)
    })
}
