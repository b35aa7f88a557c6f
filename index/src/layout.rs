//! Which directories hold the index's databases (`FORMAT.md`, "Shards").
//!
//! The index is split by group into `n` fjall databases, `shard-0` to `shard-{n-1}`
//! under the index directory, opened side by side: a database replays its whole active
//! journal when it opens, one item after another, so one database for a million keys
//! took about 1.9 s to open, and `n` of them take about a `n`-th of that on `n` cores.
//!
//! The count is fixed when the index is created and recorded in the `layout` file
//! (version byte, count byte), written before any shard, atomically (a temporary file,
//! fsynced, renamed, and the directory fsynced). An index directory without `layout`
//! that holds a fjall database itself (its `version` file) was written before the
//! split: it is read as one shard, the directory itself.

use std::fs::File;
use std::io::Write as _;
use std::path::Path;
use std::path::PathBuf;

use crate::GroupId;
use crate::error::Error;
use crate::error::Result;

/// The file recording the shard count.
pub(crate) const LAYOUT_FILE: &str = "layout";
const LAYOUT_TMP_FILE: &str = "layout.tmp";
/// Version byte of the `layout` file.
pub(crate) const LAYOUT_VERSION: u8 = 1;
/// Most shards an index may have.
pub const SHARDS_MAX: usize = 16;
/// The file fjall creates in a database directory.
const FJALL_VERSION_MARKER: &str = "version";

/// The directories of the index's databases, in shard order: those of an existing index,
/// or `shards` new ones (recorded first) for a directory holding none.
pub(crate) fn open_or_create(path: &Path, shards: usize) -> Result<Vec<PathBuf>> {
    let err = |reason: String| Error::Layout { path: path.to_path_buf(), reason };
    let io = |what: &str, e: std::io::Error| err(format!("{what}: {e}"));
    let count = match std::fs::read(path.join(LAYOUT_FILE)) {
        Ok(bytes) => decode(&bytes).map_err(err)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if path.join(FJALL_VERSION_MARKER).exists() {
                return Ok(vec![path.to_path_buf()]);
            }
            std::fs::create_dir_all(path).map_err(|e| io("cannot create the index directory", e))?;
            write_durably(path, shards).map_err(|e| io("cannot write the layout file", e))?;
            shards
        }
        Err(e) => return Err(io("cannot read the layout file", e)),
    };
    Ok((0..count).map(|shard| path.join(format!("shard-{shard}"))).collect())
}

/// The shard holding `group`'s entries and records among `shards`: the id modulo the
/// count. The controller hands replica ids out one after another, so a node's groups
/// spread evenly (a hash would leave six groups unevenly split more often than not).
pub(crate) fn shard_of(group: GroupId, shards: usize) -> usize {
    (group % shards.max(1) as u64) as usize
}

fn encode(shards: usize) -> [u8; 2] {
    [LAYOUT_VERSION, shards as u8]
}

fn decode(bytes: &[u8]) -> std::result::Result<usize, String> {
    match bytes {
        [LAYOUT_VERSION, count] if (1..=SHARDS_MAX).contains(&usize::from(*count)) => Ok(usize::from(*count)),
        [LAYOUT_VERSION, count] => Err(format!("layout file names {count} shards (1 to {SHARDS_MAX} allowed)")),
        [version, ..] if *version != LAYOUT_VERSION => {
            Err(format!("layout file has version {version}, this build reads {LAYOUT_VERSION}"))
        }
        _ => Err(format!("layout file has {} bytes, expected 2", bytes.len())),
    }
}

fn write_durably(dir: &Path, shards: usize) -> std::io::Result<()> {
    let tmp = dir.join(LAYOUT_TMP_FILE);
    let mut file = File::create(&tmp)?;
    file.write_all(&encode(shards))?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, dir.join(LAYOUT_FILE))?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_bytes_round_trip_and_bad_ones_are_refused() {
        assert_eq!(encode(2), [1, 2]);
        assert_eq!(decode(&encode(2)), Ok(2));
        assert_eq!(decode(&encode(SHARDS_MAX)), Ok(SHARDS_MAX));
        assert!(decode(&[1, 0]).is_err(), "zero shards");
        assert!(decode(&[1, SHARDS_MAX as u8 + 1]).is_err(), "too many shards");
        assert!(decode(&[2, 2]).is_err(), "unknown version");
        assert!(decode(&[1]).is_err(), "short");
        assert!(decode(&[1, 2, 0]).is_err(), "long");
    }

    #[test]
    fn consecutive_groups_take_turns_over_the_shards() {
        for shards in 1..=4 {
            let mut counts = vec![0usize; shards];
            for group in (1u64 << 20)..(1 << 20) + 6 * shards as u64 {
                counts[shard_of(group, shards)] += 1;
            }
            assert_eq!(counts, vec![6; shards]);
        }
    }

    type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

    #[test]
    fn a_new_directory_gets_the_count_asked_and_keeps_it() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("index");
        let first = open_or_create(&path, 3)?;
        assert_eq!(first, vec![path.join("shard-0"), path.join("shard-1"), path.join("shard-2")]);
        assert_eq!(open_or_create(&path, 1)?, first, "an existing index keeps its count");
        Ok(())
    }

    #[test]
    fn a_directory_holding_a_database_itself_is_one_shard() -> TestResult {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join(FJALL_VERSION_MARKER), b"x")?;
        assert_eq!(open_or_create(dir.path(), 4)?, vec![dir.path().to_path_buf()]);
        assert!(!dir.path().join(LAYOUT_FILE).exists(), "an index written before shards is left as it is");
        Ok(())
    }
}
