//! Tiered storage (ARCHITECTURE.md, "Tiered storage"): a partition's sealed segments
//! copied to an object store, the manifest of what was copied, and the local cache that
//! reads of copied segments go through.
//!
//! To ensure nothing acknowledged is lost and every replica agrees:
//! - The leader copies a sealed segment whole, as a new object (a fresh name per upload,
//!   so nothing a manifest names is ever overwritten), and only then commits a `TierCommand`
//!   `add` through Raft. The entry is the commit point: every replica records the segment
//!   in its manifest (`tier.json`, written durably) when it applies the entry.
//! - A replica deletes its local copy of a segment only once its manifest covers it.
//! - A copied segment is read from the cache, fetched first when it is not there; an object
//!   is used only when its size and CRC-32C match the manifest, and its batches are checked
//!   again when the cached copy is opened (the segment log's own recovery scan).

use std::collections::VecDeque;
use std::future::Future;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;

use bytes::Bytes;
use logdex_log::Log;
use logdex_log::LogConfig;
use logdex_log::Offset;
use object_store::ObjectStore;
use object_store::ObjectStoreExt;
use object_store::path::Path as ObjectPath;
use serde::Deserialize;
use serde::Serialize;

use crate::error::Error;
use crate::error::Result;
use crate::pb;

/// The manifest file in a partition directory (and in a snapshot).
pub const MANIFEST_FILE: &str = "tier.json";
/// Version of the manifest file format (raft/FORMAT.md, "Tier manifest").
pub const MANIFEST_VERSION: u8 = 1;
/// Directory of the partition holding fetched copies of remote segments.
pub const CACHE_DIR: &str = "tier-cache";
/// Remote segments kept in a replica's cache (open and on disk); older ones are dropped.
pub const CACHED_SEGMENTS_MAX: usize = 4;
/// Parts of a multipart upload, and the largest object stored with one put (S3 wants parts of
/// at least 5 MiB, the last excepted).
const UPLOAD_PART_BYTES: usize = 8 << 20;
/// Parts of one upload sent at once. An upload holds at most this many parts in memory, plus
/// the one being read: a segment is never read into memory whole.
const UPLOAD_PARTS_IN_FLIGHT: usize = 2;
/// Bytes of a file read at once to checksum it.
const CHECKSUM_CHUNK_BYTES: usize = 1 << 20;

/// A segment in the object store, as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteSegment {
    pub base_offset: Offset,
    /// End (exclusive) of the offsets the segment covers.
    pub next_offset: Offset,
    pub size_bytes: u64,
    /// CRC-32C of the whole object.
    pub crc32c: u32,
    /// Largest record timestamp in the segment, for retention.
    pub max_timestamp_ms: i64,
    /// Object key in the store.
    pub object: String,
}

impl RemoteSegment {
    /// The manifest entry of a copy of the local sealed segment `segment`, whose file holds
    /// `size` bytes with CRC-32C `crc`, stored as a new object of partition `partition` (Raft
    /// group `group`) of `topic`.
    pub fn of_local(
        segment: &logdex_log::SegmentInfo,
        (size, crc): (u64, u32),
        topic: &str,
        partition: u32,
        group: u64,
    ) -> RemoteSegment {
        RemoteSegment {
            base_offset: segment.base_offset,
            next_offset: segment.next_offset,
            size_bytes: size,
            crc32c: crc,
            max_timestamp_ms: segment.max_timestamp_ms,
            object: object_key(topic, partition, group, segment.base_offset, segment.next_offset),
        }
    }

    pub fn to_pb(&self) -> pb::RemoteSegment {
        pb::RemoteSegment {
            base_offset: self.base_offset,
            next_offset: self.next_offset,
            size_bytes: self.size_bytes,
            crc32c: self.crc32c,
            max_timestamp_ms: self.max_timestamp_ms,
            object: self.object.clone(),
        }
    }

    pub fn from_pb(p: &pb::RemoteSegment) -> RemoteSegment {
        RemoteSegment {
            base_offset: p.base_offset,
            next_offset: p.next_offset,
            size_bytes: p.size_bytes,
            crc32c: p.crc32c,
            max_timestamp_ms: p.max_timestamp_ms,
            object: p.object.clone(),
        }
    }

    /// Whether `offset` is in the range this segment covers.
    pub fn covers(&self, offset: Offset) -> bool {
        (self.base_offset..self.next_offset).contains(&offset)
    }
}

/// The remote segments of one partition replica, oldest first, not overlapping (gaps are
/// offsets retention removed before they were copied).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u8,
    pub segments: Vec<RemoteSegment>,
    /// Offset of the last trim (`TierCommand` `trim_to`): remote segments ending at or before
    /// it left the manifest, and their objects may be deleted.
    #[serde(default)]
    pub trimmed_to: Offset,
    /// Raft log index of that trim's entry: a snapshot taken before it still names the
    /// trimmed objects.
    #[serde(default)]
    pub trimmed_at: u64,
    /// Offset of the last forget (`TierCommand` `forget_to`, never above `trimmed_to`): the
    /// key index's cleanup watermark. A key whose entry is below it answers "not found"; one
    /// whose entry is at or above it and below the log start answers "removed". Both are
    /// committed, so every replica that holds an entry answers alike, whenever its index
    /// compactions drop the entries below the watermark.
    #[serde(default)]
    pub forgotten_to: Offset,
    /// The trims not forgotten yet, with their leaders' wall-clock times (`TierCommand`
    /// `at_ms`), oldest first, at most [`TIMED_TRIMS_MAX`]: any leader forgets a trim's keys
    /// `delete.retention.ms` after its time. A trim without a time (from a node that predates
    /// them) is not listed; the leader times it from when it sees it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timed_trims: Vec<TimedTrim>,
}

/// A trim (`trimmed_to` then) and its leader's wall-clock time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimedTrim {
    pub to: Offset,
    pub at_ms: u64,
}

/// Trims a manifest times at most; a later one takes the place of the newest (whose keys are
/// then forgotten as late as the later one's, never sooner).
pub const TIMED_TRIMS_MAX: usize = 64;

impl Default for Manifest {
    fn default() -> Manifest {
        Manifest {
            version: MANIFEST_VERSION,
            segments: Vec::new(),
            trimmed_to: 0,
            trimmed_at: 0,
            forgotten_to: 0,
            timed_trims: Vec::new(),
        }
    }
}

impl Manifest {
    /// The manifest in `dir`; empty when there is none.
    pub fn load(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Manifest::default()),
            Err(e) => return Err(e.into()),
        };
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| Error::Corrupted(format!("{}: {e}", path.display())))?;
        if manifest.version != MANIFEST_VERSION {
            return Err(Error::Corrupted(format!(
                "{}: tier manifest version {} (this build reads {MANIFEST_VERSION})",
                path.display(),
                manifest.version
            )));
        }
        Ok(manifest)
    }

    /// Writes the manifest into `dir` durably (old or new bytes after a crash).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let bytes = serde_json::to_vec(self).map_err(|e| Error::Corrupted(format!("tier manifest: {e}")))?;
        crate::partition::write_file_durably(dir, MANIFEST_FILE, &bytes)
    }

    /// First offset a remote segment covers.
    pub fn start_offset(&self) -> Option<Offset> {
        self.segments.first().map(|s| s.base_offset)
    }

    /// End (exclusive) of the last remote segment.
    pub fn end_offset(&self) -> Option<Offset> {
        self.segments.last().map(|s| s.next_offset)
    }

    /// The first remote segment that ends after `offset`: the one covering it, or the next
    /// one when `offset` falls in a gap.
    pub fn segment_from(&self, offset: Offset) -> Option<&RemoteSegment> {
        let i = self.segments.partition_point(|s| s.next_offset <= offset);
        self.segments.get(i)
    }

    /// Records a copied segment. Refused (false) when it is empty or adds no offset past the
    /// manifest's end (an upload committed twice). It may overlap the last segment: replicas
    /// roll their segments at different offsets, so a new leader's next segment can start
    /// inside one its predecessor copied.
    ///
    /// Also refused when it ends at or before the last trim: it is past retention (a leader
    /// that had not applied the trim yet copied it), and its object may be collected.
    pub fn add(&mut self, segment: RemoteSegment) -> bool {
        if segment.next_offset <= segment.base_offset
            || segment.next_offset <= self.trimmed_to
            || self.end_offset().is_some_and(|e| segment.next_offset <= e)
        {
            return false;
        }
        self.segments.push(segment);
        true
    }

    /// Whether remote segments cover every offset of `[from, to)` (no gap).
    pub fn covers_range(&self, from: Offset, to: Offset) -> bool {
        let mut at = from;
        let i = self.segments.partition_point(|s| s.next_offset <= from);
        for s in &self.segments[i..] {
            if at >= to {
                break;
            }
            if s.base_offset > at {
                return false;
            }
            at = at.max(s.next_offset);
        }
        at >= to
    }

    /// Removes the segments ending at or before `to` and returns them; records the trim
    /// (`to`, `log_index`, the Raft log index of its entry, and `at_ms`, the wall-clock time
    /// its leader proposed it at, 0 when unknown).
    pub fn trim(&mut self, to: Offset, log_index: u64, at_ms: u64) -> Vec<RemoteSegment> {
        if at_ms > 0 && to > self.trimmed_to && to > self.forgotten_to {
            let trim = TimedTrim { to, at_ms };
            if self.timed_trims.len() >= TIMED_TRIMS_MAX {
                self.timed_trims.pop();
            }
            self.timed_trims.push(trim);
        }
        self.trimmed_to = self.trimmed_to.max(to);
        self.trimmed_at = self.trimmed_at.max(log_index);
        let keep = self.segments.partition_point(|s| s.next_offset <= to);
        self.segments.drain(..keep).collect()
    }

    /// Records a forget up to `to`, never past the last trim (a forget committed before a
    /// trim it names cannot hide a record that is still readable).
    pub fn forget(&mut self, to: Offset) {
        self.forgotten_to = self.forgotten_to.max(to.min(self.trimmed_to));
        let forgotten_to = self.forgotten_to;
        self.timed_trims.retain(|t| t.to > forgotten_to);
    }

    /// The offset to forget up to at `now_ms` (wall clock) for a grace of `grace_ms`: the
    /// newest timed trim at least that old, if any.
    pub fn forget_due(&self, now_ms: u64, grace_ms: u64) -> Option<Offset> {
        self.timed_trims.iter().take_while(|t| t.at_ms.saturating_add(grace_ms) <= now_ms).last().map(|t| t.to)
    }

    pub fn size_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size_bytes).sum()
    }
}

/// The object store of a node, through the `object_store` crate: a local directory
/// (`file://` URL or a plain path; writes are fsynced before they are reported done) or an
/// S3-compatible bucket (`s3://bucket/prefix`; a write is done when the store answered it).
#[derive(Clone)]
pub struct TierStore {
    store: Arc<dyn ObjectStore>,
    location: String,
}

impl std::fmt::Debug for TierStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierStore").field("location", &self.location).finish()
    }
}

fn store_error(e: object_store::Error) -> Error {
    Error::Unavailable(format!("object store: {e}"))
}

impl TierStore {
    /// Opens the store at `location`: `s3://bucket/prefix` (endpoint, region and
    /// credentials from the standard `AWS_*` environment variables), `file:///absolute/dir`
    /// or a directory path (created when missing). Other URL schemes are refused.
    pub fn open(location: &str) -> Result<TierStore> {
        if let Some(rest) = location.strip_prefix("s3://") {
            return Self::open_s3(location, rest);
        }
        let dir = match location.strip_prefix("file://") {
            Some(path) => path,
            None if location.contains("://") => {
                return Err(Error::Invalid(format!(
                    "tiered store {location:?}: use s3://bucket/prefix, file:///dir or a directory path"
                )));
            }
            None => location,
        };
        if dir.is_empty() {
            return Err(Error::Invalid("tiered store: empty directory".into()));
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::Invalid(format!("tiered store: cannot create directory {dir:?}: {e}")))?;
        let store = object_store::local::LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| Error::Invalid(format!("tiered store {location:?}: {e}")))?
            .with_fsync(true);
        Ok(TierStore { store: Arc::new(store), location: location.to_string() })
    }

    /// An S3-compatible bucket; object keys go under `prefix` when there is one.
    fn open_s3(location: &str, rest: &str) -> Result<TierStore> {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(Error::Invalid(format!("tiered store {location:?}: no bucket named")));
        }
        // HTTPS through rustls with ring; a second install (another store) is refused and harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        // A store that does not answer fails a request within about a minute (30 s per try,
        // 3 retries within 60 s), not object_store's default of 3 minutes: a read waiting
        // for a remote segment is bounded by it.
        let retry = object_store::RetryConfig {
            max_retries: S3_RETRIES_MAX,
            retry_timeout: S3_RETRY_TIMEOUT,
            ..Default::default()
        };
        let s3 = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_retry(retry)
            .build()
            .map_err(|e| Error::Invalid(format!("tiered store {location:?}: {e}")))?;
        let prefix = prefix.trim_matches('/');
        let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
            Arc::new(s3)
        } else {
            let prefix = ObjectPath::parse(prefix)
                .map_err(|e| Error::Invalid(format!("tiered store {location:?}: prefix: {e}")))?;
            Arc::new(object_store::prefix::PrefixStore::new(s3, prefix))
        };
        Ok(TierStore { store, location: location.to_string() })
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    /// A store over any `ObjectStore` (a throttled one in tests).
    #[cfg(test)]
    pub(crate) fn over(store: Arc<dyn ObjectStore>) -> TierStore {
        TierStore { store, location: "test".into() }
    }

    fn path(key: &str) -> Result<ObjectPath> {
        ObjectPath::parse(key).map_err(|e| Error::Invalid(format!("object key {key:?}: {e}")))
    }

    /// Stores `bytes` as `key`, durably, atomically (no reader sees part of it).
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let (store, path) = (self.store.clone(), Self::path(key)?);
        on_io(async move { store.put(&path, bytes.into()).await.map(|_| ()).map_err(store_error) }).await
    }

    /// Stores the first `size` bytes of `file` as `key`, durably, atomically: with one put
    /// when they fit in one part ([`UPLOAD_PART_BYTES`]), else as a multipart upload, read
    /// from the file a part at a time. A failed multipart upload is aborted.
    pub async fn put_file(&self, key: &str, file: std::fs::File, size: u64) -> Result<()> {
        self.put_file_in_parts(key, file, size, UPLOAD_PART_BYTES).await
    }

    async fn put_file_in_parts(&self, key: &str, file: std::fs::File, size: u64, part: usize) -> Result<()> {
        use tokio::io::AsyncReadExt as _;
        let (store, path) = (self.store.clone(), Self::path(key)?);
        let short = format!("the file to store as {key} is shorter than its {size} bytes");
        on_io(async move {
            let mut file = tokio::fs::File::from_std(file).take(size);
            if size <= part as u64 {
                let mut bytes = Vec::with_capacity(size as usize);
                file.read_to_end(&mut bytes).await?;
                if bytes.len() as u64 != size {
                    return Err(Error::Corrupted(short));
                }
                return store.put(&path, Bytes::from(bytes).into()).await.map(|_| ()).map_err(store_error);
            }
            let upload = store.put_multipart(&path).await.map_err(store_error)?;
            let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, part);
            let mut sent = 0u64;
            let read = loop {
                if sent == size {
                    break Ok(());
                }
                let mut chunk = Vec::with_capacity(part);
                match (&mut file).take(part as u64).read_to_end(&mut chunk).await {
                    Ok(0) => break Err(Error::Corrupted(short)),
                    Ok(n) => sent += n as u64,
                    Err(e) => break Err(e.into()),
                }
                if let Err(e) = writer.wait_for_capacity(UPLOAD_PARTS_IN_FLIGHT).await {
                    break Err(store_error(e));
                }
                writer.put(Bytes::from(chunk));
            };
            match read {
                // `finish` aborts the upload itself when a part or the completion fails.
                Ok(()) => writer.finish().await.map(|_| ()).map_err(store_error),
                Err(e) => {
                    if let Err(abort) = writer.abort().await {
                        tracing::warn!(error = %abort, "cannot abort a failed multipart upload");
                    }
                    Err(e)
                }
            }
        })
        .await
    }

    /// Writes the object `key` into the new file `dest` as the store streams it, and returns
    /// its size and CRC-32C; [`Error::NotFound`] when the store does not hold it.
    pub async fn get_to_file(&self, key: &str, dest: &Path) -> Result<(u64, u32)> {
        use futures::StreamExt as _;
        use tokio::io::AsyncWriteExt as _;
        let (store, path, dest) = (self.store.clone(), Self::path(key)?, dest.to_path_buf());
        let missing = format!("object {key} in the tiered store {}", self.location);
        on_io(async move {
            let got = match store.get(&path).await {
                Ok(got) => got,
                Err(object_store::Error::NotFound { .. }) => return Err(Error::NotFound(missing)),
                Err(e) => return Err(store_error(e)),
            };
            let range = got.range.clone();
            let mut chunks = match got.payload {
                // A directory store hands over the object's file: copied off the runtime, in
                // large reads (its stream reads 8 KiB at a time, each a blocking task).
                object_store::GetResultPayload::File(mut file, _) => {
                    let copy = move || -> Result<(u64, u32)> {
                        use std::io::Seek as _;
                        file.seek(std::io::SeekFrom::Start(range.start))?;
                        let mut out = std::fs::File::create(&dest)?;
                        copy_summing(std::io::Read::take(file, range.end - range.start), &mut out)
                    };
                    return tokio::task::spawn_blocking(copy)
                        .await
                        .map_err(|e| Error::Unavailable(format!("object copy did not finish: {e}")))?;
                }
                object_store::GetResultPayload::Stream(chunks) => chunks,
            };
            let file = tokio::fs::File::create(&dest).await?;
            let mut file = tokio::io::BufWriter::with_capacity(CHECKSUM_CHUNK_BYTES, file);
            let (mut size, mut crc) = (0u64, 0u32);
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk.map_err(store_error)?;
                crc = crc32c::crc32c_append(crc, &chunk);
                size += chunk.len() as u64;
                file.write_all(&chunk).await?;
            }
            file.flush().await?;
            Ok((size, crc))
        })
        .await
    }

    /// Whether the store holds `key`.
    pub async fn exists(&self, key: &str) -> Result<bool> {
        let (store, path) = (self.store.clone(), Self::path(key)?);
        on_io(async move {
            match store.head(&path).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(store_error(e)),
            }
        })
        .await
    }

    /// The paths of every object under `prefix/`.
    async fn list_paths(&self, prefix: &str) -> Result<Vec<ObjectPath>> {
        let (store, prefix) = (self.store.clone(), Self::path(prefix)?);
        on_io(async move {
            use futures::StreamExt;
            let mut listed = store.list(Some(&prefix));
            let mut paths = Vec::new();
            while let Some(meta) = listed.next().await {
                paths.push(meta.map_err(store_error)?.location);
            }
            Ok(paths)
        })
        .await
    }

    /// The keys of every object under `prefix/`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>> {
        Ok(self.list_paths(prefix).await?.iter().map(ToString::to_string).collect())
    }

    /// The partition's trim marker: the largest offset among the objects
    /// `<prefix>/trimmed-to/<offset:020>`. Every copy of a segment ending at or before it may
    /// have been deleted. 0 when there is none.
    pub async fn trimmed_to(&self, prefix: &str) -> Result<Offset> {
        let markers = self.list(&format!("{prefix}/{TRIM_MARKER}")).await?;
        Ok(markers.iter().filter_map(|k| k.rsplit('/').next()?.parse::<Offset>().ok()).max().unwrap_or(0))
    }

    /// Raises the partition's trim marker to `to`; written, durably, before any object below
    /// it is deleted. A marker is one object per trim point, so two leaders raising it at once
    /// never lower it (the largest stands); smaller ones are removed after.
    pub async fn raise_trimmed_to(&self, prefix: &str, to: Offset) -> Result<()> {
        let dir = format!("{prefix}/{TRIM_MARKER}");
        self.put(&format!("{dir}/{to:020}"), Bytes::from(to.to_string())).await?;
        for key in self.list(&dir).await? {
            if key.rsplit('/').next().and_then(|n| n.parse::<Offset>().ok()).is_some_and(|o| o < to) {
                self.delete(&key).await?;
            }
        }
        Ok(())
    }

    /// Deletes every object under `prefix/` (a deleted partition's `<topic>/<partition>-<group>`).
    /// Returns how many were deleted.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<usize> {
        let paths = self.list_paths(prefix).await?;
        let count = paths.len();
        let store = self.store.clone();
        on_io(async move {
            for path in &paths {
                match store.delete(path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(store_error(e)),
                }
            }
            Ok(())
        })
        .await?;
        Ok(count)
    }

    /// Deletes `key`; a missing object is not an error.
    pub async fn delete(&self, key: &str) -> Result<()> {
        let (store, path) = (self.store.clone(), Self::path(key)?);
        on_io(async move {
            match store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(store_error(e)),
            }
        })
        .await
    }
}

/// The runtime every object store request runs on: one thread of its own, apart from the
/// node's workers. Code that must wait for a remote segment while it holds a replica's
/// locks (an index rebuild during a snapshot install) blocks its thread on the request; a
/// lookup of that replica then blocks a worker on the locks. With the request's connection
/// driven by the workers (an S3 store's HTTP connection is a task), a node with one worker
/// stopped for good. Here the request goes on whatever the workers do.
fn io_runtime() -> Result<&'static tokio::runtime::Runtime> {
    static IO: std::sync::OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = std::sync::OnceLock::new();
    IO.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("logdex-object-store")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| Error::Unavailable(format!("cannot start the object store's runtime: {e}")))
}

/// Runs `request` on the object store's runtime ([`io_runtime`]) and waits for it.
async fn on_io<T: Send + 'static>(request: impl Future<Output = Result<T>> + Send + 'static) -> Result<T> {
    io_runtime()?
        .spawn(request)
        .await
        .map_err(|e| Error::Unavailable(format!("object store request did not finish: {e}")))?
}

/// Retries of a failed S3 request, and how long after the first try they may start.
const S3_RETRIES_MAX: usize = 3;
const S3_RETRY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Name of the trim marker directory in a partition's prefix.
pub const TRIM_MARKER: &str = "trimmed-to";

/// The prefix of an object key (its partition's `<topic>/<partition>-<group>`).
pub fn prefix_of(object: &str) -> &str {
    object.rsplit_once('/').map_or("", |(prefix, _)| prefix)
}

/// The offsets `(base, next)` an object key names, from its file name.
pub fn range_of_key(object: &str) -> Option<(Offset, Offset)> {
    let name = object.rsplit('/').next()?;
    let mut parts = name.split('-');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The prefix of every object key of one partition's copies (Raft group `group`).
pub fn object_prefix(topic: &str, partition: u32, group: u64) -> String {
    format!("{topic}/{partition}-{group}")
}

/// The object key of an upload of the segment `[base, next)` of partition `partition` (Raft
/// group `group`: a topic created again under the same name has new groups): unique per
/// upload, so a second upload of the same segment (a new leader) never replaces an object
/// a manifest names.
pub fn object_key(topic: &str, partition: u32, group: u64, base: Offset, next: Offset) -> String {
    format!("{}/{base:020}-{next:020}-{:016x}.log", object_prefix(topic, partition, group), rand::random::<u64>())
}

/// The range a cached copy covers: remote segments are told apart by both ends (two
/// leaders may copy segments that start at the same offset and end at different ones).
type Range = (Offset, Offset);

fn range_of(segment: &RemoteSegment) -> Range {
    (segment.base_offset, segment.next_offset)
}

/// Fetched copies of remote segments, each in `tier-cache/{base:020}-{next:020}/` as a
/// one-segment log.
pub struct TierCache {
    dir: PathBuf,
    store: Option<TierStore>,
    /// Most recently used last.
    open: Mutex<VecDeque<(Range, Arc<Log>)>>,
    /// One fetch at a time per replica: readers missing the same segment wait for one
    /// download instead of each starting their own.
    fetching: tokio::sync::Mutex<()>,
    /// Held while a copy is written, opened or removed (a read's fetch and an install's
    /// rebuild may work on the same copy at once).
    files: Mutex<()>,
}

impl TierCache {
    /// The cache in `dir`; copies a crash left half written (`*.tmp`) are removed.
    pub fn new(dir: PathBuf, store: Option<TierStore>) -> TierCache {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().ends_with(".tmp") {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        TierCache {
            dir,
            store,
            open: Mutex::new(VecDeque::new()),
            fetching: tokio::sync::Mutex::new(()),
            files: Mutex::new(()),
        }
    }

    pub fn store(&self) -> Option<&TierStore> {
        self.store.as_ref()
    }

    fn segment_dir(&self, (base, next): Range) -> PathBuf {
        self.dir.join(format!("{base:020}-{next:020}"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(Range, Arc<Log>)>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached copy of `segment` if it is open; cheap, for the read path. `None` when it
    /// is not (fetch it: [`TierCache::fetch`]).
    pub fn get(&self, segment: &RemoteSegment) -> Option<Arc<Log>> {
        let range = range_of(segment);
        let mut open = self.lock();
        let i = open.iter().position(|(r, _)| *r == range)?;
        let entry = open.remove(i)?;
        let log = entry.1.clone();
        open.push_back(entry);
        Some(log)
    }

    /// Opens the copy of `segment` on disk, after checking it whole against the manifest
    /// entry: size and CRC-32C, then every batch (the segment log's recovery scan, which
    /// cuts a copy at its first damaged batch, so a cut copy no longer has the entry's size),
    /// and its offsets. `None` when there is no copy or it fails the size and CRC check (it
    /// is dropped). Reads the whole file: call it off the async workers ([`blocking`]).
    fn load(&self, segment: &RemoteSegment) -> Result<Option<Arc<Log>>> {
        if let Some(log) = self.get(segment) {
            return Ok(Some(log));
        }
        let _files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(log) = self.get(segment) {
            return Ok(Some(log));
        }
        let dir = self.segment_dir(range_of(segment));
        let file = dir.join(logdex_log::segment_file_name(segment.base_offset));
        let sum = match file_sum(&file) {
            Ok(sum) => sum,
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if check_sum(segment, sum).is_err() {
            tracing::warn!(file = %file.display(), "dropping a cached remote segment that fails its checks");
            remove_dir(&dir)?;
            return Ok(None);
        }
        self.open_checked(segment).map(Some)
    }

    /// Opens the copy of `segment` whose bytes passed the size and CRC-32C check: the batch
    /// scan and the offsets, then keeps it open.
    fn open_checked(&self, segment: &RemoteSegment) -> Result<Arc<Log>> {
        let dir = self.segment_dir(range_of(segment));
        let log = Arc::new(Log::open(&dir, LogConfig::default())?);
        // A compacted segment may end before the next one starts: its end is at most `next`.
        if log.size_bytes() != segment.size_bytes
            || log.start_offset() != segment.base_offset
            || log.next_offset() > segment.next_offset
        {
            remove_dir(&dir)?;
            return Err(Error::Corrupted(format!(
                "remote segment {} holds {} bytes of offsets {}..{}, its manifest entry says {} bytes of {}..{}",
                segment.object,
                log.size_bytes(),
                log.start_offset(),
                log.next_offset(),
                segment.size_bytes,
                segment.base_offset,
                segment.next_offset
            )));
        }
        self.remember(range_of(segment), log.clone())?;
        Ok(log)
    }

    /// A new temporary directory for a copy of `segment`, and the path its segment file
    /// takes there. Each call gets its own (a read's fetch and an install's rebuild may fetch
    /// the same segment at once); [`TierCache::new`] removes those a crash left.
    fn tmp_copy(&self, segment: &RemoteSegment) -> Result<(PathBuf, PathBuf)> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (base, next) = range_of(segment);
        let tmp = self.dir.join(format!("{base:020}-{next:020}.{n}.tmp"));
        remove_dir(&tmp)?;
        std::fs::create_dir_all(&tmp)?;
        let file = tmp.join(logdex_log::segment_file_name(segment.base_offset));
        Ok((tmp, file))
    }

    /// Makes the copy in `tmp`, whose file has size and CRC-32C `sum`, the cached copy of
    /// `segment`, and opens it: checked against the manifest entry as [`TierCache::load`]
    /// checks a copy. A copy that fails is removed.
    fn install(&self, segment: &RemoteSegment, tmp: &Path, sum: (u64, u32)) -> Result<Arc<Log>> {
        let _files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = check_sum(segment, sum) {
            remove_dir(tmp)?;
            return Err(e);
        }
        let range = range_of(segment);
        let dir = self.segment_dir(range);
        self.lock().retain(|(r, _)| *r != range);
        remove_dir(&dir)?;
        std::fs::rename(tmp, &dir)?;
        self.open_checked(segment)
    }

    /// Copies the local sealed segment `local` into the cache and opens the copy, checked as
    /// a fetched copy is: the leader checks a segment this way before it copies it to the
    /// store, so a damaged local file is never copied. Returns the copy's manifest entry, as
    /// a new object of partition `partition` (Raft group `group`) of `topic`, and its file
    /// open for reading, which stays readable if the cache drops the copy meanwhile.
    pub fn copy_local(
        &self,
        local: &logdex_log::SegmentInfo,
        topic: &str,
        partition: u32,
        group: u64,
    ) -> Result<(RemoteSegment, std::fs::File)> {
        let mut remote = RemoteSegment::of_local(local, (0, 0), topic, partition, group);
        let (tmp, file) = self.tmp_copy(&remote)?;
        let copied = std::fs::copy(&local.path, &file)
            .map_err(Error::from)
            .and_then(|_| file_sum(&file))
            .and_then(|sum| Ok((sum, std::fs::File::open(&file)?)));
        let (sum, reader) = match copied {
            Ok(copied) => copied,
            Err(e) => {
                remove_dir(&tmp)?;
                return Err(e);
            }
        };
        (remote.size_bytes, remote.crc32c) = sum;
        self.install(&remote, &tmp, sum)?;
        Ok((remote, reader))
    }

    fn remember(&self, range: Range, log: Arc<Log>) -> Result<()> {
        let evicted: Vec<Range> = {
            let mut open = self.lock();
            open.retain(|(r, _)| *r != range);
            open.push_back((range, log));
            let excess = open.len().saturating_sub(CACHED_SEGMENTS_MAX);
            open.drain(..excess).map(|(r, _)| r).collect()
        };
        // Readers holding an evicted log keep its open files; the names go now.
        for range in evicted {
            remove_dir(&self.segment_dir(range))?;
        }
        Ok(())
    }

    /// Makes `segment` open in the cache: from the copy on disk, else fetched from the store.
    /// One fetch at a time per replica; the file work runs off the async workers.
    pub async fn fetch(&self, segment: &RemoteSegment) -> Result<()> {
        let store = self.store.as_ref().ok_or_else(no_store)?;
        let _one = self.fetching.lock().await;
        if blocking(|| self.load(segment))?.is_some() {
            return Ok(());
        }
        let (tmp, file) = blocking(|| self.tmp_copy(segment))?;
        // A copy cut short by a stop of the node is removed when the cache opens next.
        match store.get_to_file(&segment.object, &file).await {
            Ok(sum) => blocking(|| self.install(segment, &tmp, sum)).map(|_| ()),
            Err(e) => {
                blocking(|| remove_dir(&tmp))?;
                Err(e)
            }
        }
    }

    /// The cached copy of `segment`, fetched first when missing, from synchronous code (the
    /// index rebuild of a replica whose segments are partly remote). Blocks the thread.
    /// [`Error::NotFound`] when the store does not hold the object.
    pub fn get_or_fetch_blocking(&self, segment: &RemoteSegment) -> Result<Arc<Log>> {
        if let Some(log) = self.load(segment)? {
            return Ok(log);
        }
        let store = self.store.as_ref().ok_or_else(no_store)?;
        let (tmp, file) = self.tmp_copy(segment)?;
        match futures::executor::block_on(store.get_to_file(&segment.object, &file)) {
            Ok(sum) => self.install(segment, &tmp, sum),
            Err(e) => {
                remove_dir(&tmp)?;
                Err(e)
            }
        }
    }

    /// Drops the cached copies of segments ending at or before `to` (trimmed by retention),
    /// those on disk included.
    pub fn forget_below(&self, to: Offset) -> Result<()> {
        let _files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        self.lock().retain(|((_, next), _)| *next > to);
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let next = name.to_str().and_then(|n| n.split('-').nth(1)).and_then(|n| n.parse::<Offset>().ok());
            if next.is_some_and(|next| next <= to) {
                remove_dir(&entry.path())?;
            }
        }
        Ok(())
    }
}

/// Runs file work that may take a while (reading and checking a whole segment) so that the
/// async worker it is called on hands its other tasks to another thread meanwhile (on a
/// multi-thread runtime; elsewhere it just runs).
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn no_store() -> Error {
    Error::Unavailable("the data is in tiered storage and this node has no --tiered-store".into())
}

/// The size and CRC-32C of the file at `path`, read a chunk at a time.
fn file_sum(path: &Path) -> Result<(u64, u32)> {
    copy_summing(std::fs::File::open(path)?, &mut std::io::sink())
}

/// Copies everything `from` reads into `to`, a chunk at a time, and returns its size and CRC-32C.
fn copy_summing(mut from: impl std::io::Read, to: &mut impl std::io::Write) -> Result<(u64, u32)> {
    let mut chunk = vec![0u8; CHECKSUM_CHUNK_BYTES];
    let (mut size, mut crc) = (0u64, 0u32);
    loop {
        let n = match from.read(&mut chunk) {
            Ok(0) => return Ok((size, crc)),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        crc = crc32c::crc32c_append(crc, &chunk[..n]);
        size += n as u64;
        to.write_all(&chunk[..n])?;
    }
}

/// Whether a copy of `segment` with size and CRC-32C `(size, crc)` is the object its manifest
/// entry names.
fn check_sum(segment: &RemoteSegment, (size, crc): (u64, u32)) -> Result<()> {
    if size != segment.size_bytes || crc != segment.crc32c {
        return Err(Error::Corrupted(format!(
            "remote segment {}: {size} bytes with CRC-32C {crc:08x}, the manifest says {} bytes with {:08x}",
            segment.object, segment.size_bytes, segment.crc32c
        )));
    }
    Ok(())
}

fn remove_dir(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

    fn segment(base: Offset, next: Offset) -> RemoteSegment {
        RemoteSegment {
            base_offset: base,
            next_offset: next,
            size_bytes: 0,
            crc32c: 0,
            max_timestamp_ms: 0,
            object: format!("t/0/{base}"),
        }
    }

    #[test]
    fn manifest_takes_segments_that_extend_it_and_knows_what_it_covers() {
        let mut m = Manifest::default();
        assert!(m.add(segment(0, 10)));
        assert!(!m.add(segment(0, 10)), "the same upload committed twice");
        assert!(!m.add(segment(2, 8)), "nothing past the end");
        assert!(!m.add(segment(12, 12)), "empty");
        assert!(m.add(segment(5, 12)), "overlapping, but it extends the end");
        assert!(m.add(segment(15, 30)), "a gap retention left is fine");
        assert_eq!((m.start_offset(), m.end_offset()), (Some(0), Some(30)));
        assert_eq!(m.segment_from(3).map(|s| s.base_offset), Some(0));
        assert_eq!(m.segment_from(10).map(|s| s.base_offset), Some(5));
        assert_eq!(m.segment_from(12).map(|s| s.base_offset), Some(15), "in the gap: the next segment");
        assert!(m.segment_from(30).is_none());
        assert!(m.covers_range(0, 12));
        assert!(m.covers_range(3, 11));
        assert!(!m.covers_range(10, 16), "the gap 12..15");
        assert!(m.covers_range(15, 30));
        assert!(!m.covers_range(20, 31));
    }

    #[test]
    fn manifest_trim_removes_whole_segments_ending_at_or_before_the_offset() {
        let mut m = Manifest::default();
        for (b, n) in [(0, 10), (10, 20), (20, 30)] {
            assert!(m.add(segment(b, n)));
        }
        assert!(m.trim(15, 7, 0).iter().map(|s| s.base_offset).eq([0]));
        assert!(m.trim(20, 9, 0).iter().map(|s| s.base_offset).eq([10]));
        assert_eq!((m.trimmed_to, m.trimmed_at), (20, 9));
        assert!(m.trim(18, 8, 0).is_empty(), "an older trim moves nothing back");
        assert_eq!((m.trimmed_to, m.trimmed_at), (20, 9));
        assert!(m.trim(30, 10, 0).iter().map(|s| s.base_offset).eq([20]));
        assert!(!m.add(segment(25, 30)), "past retention: ends at the trim");
        assert!(m.add(segment(25, 31)), "reaches past the trim");
        assert_eq!(m.start_offset(), Some(25));
    }

    #[test]
    fn timed_trims_are_forgotten_a_grace_after_their_time_and_dropped_once_forgotten() {
        let mut m = Manifest::default();
        m.trim(10, 1, 1_000);
        m.trim(20, 2, 5_000);
        m.trim(15, 3, 6_000);
        m.trim(30, 4, 0);
        assert_eq!(m.timed_trims, [TimedTrim { to: 10, at_ms: 1_000 }, TimedTrim { to: 20, at_ms: 5_000 }]);
        assert_eq!(m.forget_due(1_999, 1_000), None);
        assert_eq!(m.forget_due(2_000, 1_000), Some(10));
        assert_eq!(m.forget_due(9_000, 1_000), Some(20), "the newest due");
        m.forget(10);
        assert_eq!(m.timed_trims, [TimedTrim { to: 20, at_ms: 5_000 }]);
        m.forget(25);
        assert!(m.timed_trims.is_empty());
        assert_eq!(m.forget_due(u64::MAX, 0), None);

        // At the bound, a later trim takes the newest's place: forgotten later, never sooner.
        let mut m = Manifest::default();
        for i in 1..=TIMED_TRIMS_MAX as u64 + 1 {
            m.trim(i * 10, i, i * 1_000);
        }
        assert_eq!(m.timed_trims.len(), TIMED_TRIMS_MAX);
        let last = TIMED_TRIMS_MAX as u64 + 1;
        assert_eq!(m.timed_trims.last(), Some(&TimedTrim { to: last * 10, at_ms: last * 1_000 }));
        assert_eq!(m.forget_due((last - 1) * 1_000, 0), Some((last - 2) * 10));
    }

    #[test]
    fn manifest_survives_save_and_load_and_refuses_an_unknown_version() -> TestResult {
        let dir = tempfile::tempdir()?;
        assert_eq!(Manifest::load(dir.path())?, Manifest::default());
        let mut m = Manifest::default();
        assert!(m.add(segment(4, 9)));
        m.save(dir.path())?;
        assert_eq!(Manifest::load(dir.path())?, m);
        m.version = 9;
        std::fs::write(dir.path().join(MANIFEST_FILE), serde_json::to_vec(&m)?)?;
        assert!(matches!(Manifest::load(dir.path()), Err(Error::Corrupted(_))));
        Ok(())
    }

    /// A one-segment log holding records 0..3 and its bytes.
    fn segment_bytes(dir: &Path) -> Result<(RemoteSegment, Vec<u8>)> {
        let mut log = Log::open(dir, LogConfig::default())?;
        let record = |i: u8| logdex_log::Record {
            timestamp_ms: 5,
            key: Some(vec![b'k', i]),
            value: Some(vec![i; 10]),
            headers: Vec::new(),
        };
        let mut batch = logdex_log::encode_batch(&[record(0), record(1), record(2)], logdex_log::Compression::None)?;
        log.append(&mut batch, 0)?;
        log.sync()?;
        let bytes = std::fs::read(dir.join(logdex_log::segment_file_name(0)))?;
        let seg = RemoteSegment {
            base_offset: 0,
            next_offset: 3,
            size_bytes: bytes.len() as u64,
            crc32c: crc32c::crc32c(&bytes),
            max_timestamp_ms: 5,
            object: "t/0/seg".into(),
        };
        Ok((seg, bytes))
    }

    #[tokio::test]
    async fn a_segment_put_in_the_store_is_fetched_into_the_cache_and_read() -> TestResult {
        let root = tempfile::tempdir()?;
        let (seg, bytes) = segment_bytes(&root.path().join("source"))?;
        let store = TierStore::open(&format!("file://{}", root.path().join("store").display()))?;
        store.put(&seg.object, Bytes::from(bytes)).await?;
        let cache = TierCache::new(root.path().join("cache"), Some(store.clone()));
        assert!(cache.get(&seg).is_none(), "nothing cached yet");
        cache.fetch(&seg).await?;
        let log = cache.get(&seg).ok_or("cached")?;
        let (offset, record) = log.read_record(1)?.ok_or("record 1")?;
        assert_eq!((offset, record.key), (1, Some(vec![b'k', 1])));
        store.delete(&seg.object).await?;
        store.delete(&seg.object).await?;
        assert!(matches!(stored(&store, &seg.object, root.path()).await, Err(Error::NotFound(_))));
        for key in ["t/0-7/a.log", "t/0-7/b.log", "t/0-8/a.log"] {
            store.put(key, Bytes::from_static(b"x")).await?;
        }
        assert_eq!(store.trimmed_to("t/0-7").await?, 0);
        store.raise_trimmed_to("t/0-7", 30).await?;
        store.raise_trimmed_to("t/0-7", 20).await?;
        assert_eq!(store.trimmed_to("t/0-7").await?, 30, "a smaller trim point never lowers the marker");
        assert_eq!(store.delete_prefix("t/0-7").await?, 4);
        assert_eq!(store.trimmed_to("t/0-7").await?, 0);
        assert!(!store.exists("t/0-7/a.log").await? && store.exists("t/0-8/a.log").await?);
        Ok(())
    }

    /// The bytes of the object `key`, through a file in `dir`.
    async fn stored(store: &TierStore, key: &str, dir: &Path) -> Result<Vec<u8>> {
        let file = dir.join("stored");
        store.get_to_file(key, &file).await?;
        Ok(std::fs::read(file)?)
    }

    /// Makes `bytes` the cached copy of `seg`, as a fetch does with what it downloaded.
    fn fill_and_open(cache: &TierCache, seg: &RemoteSegment, bytes: &[u8]) -> Result<Arc<Log>> {
        let (tmp, file) = cache.tmp_copy(seg)?;
        std::fs::write(&file, bytes)?;
        cache.install(seg, &tmp, (bytes.len() as u64, crc32c::crc32c(bytes)))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_local_segment_is_copied_to_the_store_in_parts_and_fetched_back_whole() -> TestResult {
        let root = tempfile::tempdir()?;
        let source = root.path().join("source");
        let (_, bytes) = segment_bytes(&source)?;
        let local = logdex_log::SegmentInfo {
            base_offset: 0,
            next_offset: 3,
            size_bytes: bytes.len() as u64,
            sealed: true,
            max_timestamp_ms: 5,
            path: source.join(logdex_log::segment_file_name(0)),
        };
        let store = TierStore::open(&format!("file://{}", root.path().join("store").display()))?;
        let leader = TierCache::new(root.path().join("leader-cache"), Some(store.clone()));
        let (remote, copy) = leader.copy_local(&local, "t", 0, 7)?;
        assert_eq!((remote.size_bytes, remote.crc32c), (bytes.len() as u64, crc32c::crc32c(&bytes)));
        assert!(leader.get(&remote).is_some(), "the leader keeps its checked copy open");
        // Parts far smaller than the segment: a multipart upload of many parts.
        let part = bytes.len() / 5;
        store.put_file_in_parts(&remote.object, copy, remote.size_bytes, part).await?;
        assert_eq!(stored(&store, &remote.object, root.path()).await?, bytes, "stored as the segment's bytes");

        let follower = TierCache::new(root.path().join("follower-cache"), Some(store.clone()));
        follower.fetch(&remote).await?;
        let (offset, record) = follower.get(&remote).ok_or("fetched")?.read_record(2)?.ok_or("record 2")?;
        assert_eq!((offset, record.key), (2, Some(vec![b'k', 2])));
        let leftovers: Vec<_> = std::fs::read_dir(root.path().join("follower-cache"))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()?;
        assert_eq!(leftovers.len(), 1, "only the copy itself, no temporary file: {leftovers:?}");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_file_shorter_than_the_size_to_store_is_not_stored() -> TestResult {
        let root = tempfile::tempdir()?;
        let (seg, bytes) = segment_bytes(&root.path().join("source"))?;
        let path = root.path().join("source").join(logdex_log::segment_file_name(0));
        let store = TierStore::open(&format!("file://{}", root.path().join("store").display()))?;
        let size = bytes.len() as u64 + 1;
        for part in [bytes.len() + 10, bytes.len() / 3] {
            let stored = store.put_file_in_parts(&seg.object, std::fs::File::open(&path)?, size, part).await;
            assert!(matches!(stored, Err(Error::Corrupted(_))), "part of {part} bytes: {stored:?}");
            assert!(!store.exists(&seg.object).await?, "part of {part} bytes: nothing stored");
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_fetched_object_that_does_not_match_its_manifest_entry_is_not_cached() -> TestResult {
        let root = tempfile::tempdir()?;
        let (seg, mut bytes) = segment_bytes(&root.path().join("source"))?;
        let store = TierStore::open(&format!("file://{}", root.path().join("store").display()))?;
        bytes[20] ^= 1;
        store.put(&seg.object, Bytes::from(bytes)).await?;
        let cache = TierCache::new(root.path().join("cache"), Some(store.clone()));
        assert!(matches!(cache.fetch(&seg).await, Err(Error::Corrupted(_))));
        assert!(cache.get(&seg).is_none());
        assert_eq!(std::fs::read_dir(root.path().join("cache"))?.count(), 0, "nothing left behind");
        let missing = RemoteSegment { object: "t/0/missing".into(), ..seg };
        assert!(matches!(cache.fetch(&missing).await, Err(Error::NotFound(_))));
        assert_eq!(std::fs::read_dir(root.path().join("cache"))?.count(), 0, "nothing left behind");
        Ok(())
    }

    #[test]
    fn an_object_that_does_not_match_its_manifest_entry_is_refused() -> TestResult {
        let root = tempfile::tempdir()?;
        let (seg, mut bytes) = segment_bytes(&root.path().join("source"))?;
        let cache = TierCache::new(root.path().join("cache"), None);
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(matches!(fill_and_open(&cache, &seg, &bytes), Err(Error::Corrupted(_))));
        assert_eq!(std::fs::read_dir(root.path().join("cache"))?.count(), 0, "the refused copy is gone");
        assert!(cache.load(&seg)?.is_none());
        assert!(matches!(cache.get_or_fetch_blocking(&seg), Err(Error::Unavailable(_))), "no store to fetch from");
        Ok(())
    }

    #[test]
    fn copies_of_segments_starting_at_the_same_offset_are_kept_apart_and_trimmed_by_their_end() -> TestResult {
        let root = tempfile::tempdir()?;
        let (seg, bytes) = segment_bytes(&root.path().join("source"))?;
        let cache = TierCache::new(root.path().join("cache"), None);
        fill_and_open(&cache, &seg, &bytes)?;
        let longer = RemoteSegment { next_offset: seg.next_offset + 5, object: "t/0/longer".into(), ..seg.clone() };
        assert!(cache.get(&longer).is_none(), "another leader's copy of a longer range is not this one");
        assert!(cache.load(&longer)?.is_none());
        cache.forget_below(seg.next_offset - 1)?;
        assert!(cache.get(&seg).is_some(), "ends after the trim point");
        cache.forget_below(seg.next_offset)?;
        assert!(cache.get(&seg).is_none());
        assert!(cache.load(&seg)?.is_none(), "its copy on disk went too");
        Ok(())
    }

    #[test]
    fn stores_are_s3_buckets_or_local_directories() {
        assert!(TierStore::open("s3://bucket/some/prefix").is_ok(), "an S3 bucket with a prefix");
        assert!(TierStore::open("s3://bucket").is_ok(), "an S3 bucket");
        assert!(matches!(TierStore::open("s3:///prefix"), Err(Error::Invalid(_))), "no bucket");
        assert!(matches!(TierStore::open("gs://bucket/prefix"), Err(Error::Invalid(_))));
        assert!(matches!(TierStore::open(""), Err(Error::Invalid(_))));
    }

    #[test]
    fn a_store_directory_that_cannot_be_created_is_named_in_the_error() -> TestResult {
        let root = tempfile::tempdir()?;
        let file = root.path().join("file");
        std::fs::write(&file, b"x")?;
        let under_a_file = file.join("store");
        let Err(e) = TierStore::open(&under_a_file.to_string_lossy()) else {
            return Err("a directory under a file was opened".into());
        };
        assert!(e.to_string().contains(&*under_a_file.to_string_lossy()), "{e}");
        Ok(())
    }

    #[test]
    fn the_cache_keeps_a_bounded_number_of_segments() -> TestResult {
        let root = tempfile::tempdir()?;
        let (seg, bytes) = segment_bytes(&root.path().join("source"))?;
        let cache = TierCache::new(root.path().join("cache"), None);
        fill_and_open(&cache, &seg, &bytes)?;
        assert!(cache.get(&seg).is_some());
        for base in 1..=CACHED_SEGMENTS_MAX as u64 {
            let log = Arc::new(Log::open(&root.path().join(format!("other{base}")), LogConfig::default())?);
            cache.remember((base * 100, base * 100 + 1), log)?;
        }
        assert!(!cache.segment_dir(range_of(&seg)).exists(), "the least recently used segment left the disk");
        assert!(cache.get(&seg).is_none());
        assert!(cache.load(&seg)?.is_none());
        Ok(())
    }
}
