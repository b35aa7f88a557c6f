//! Snapshots as directories of files.
//!
//! A partition snapshot is a checkpoint of its segment log (hard-linked
//! segment files, so compaction cannot change them underneath) plus
//! `state.json` (applied log id, membership, next offset); a controller
//! snapshot is a copy of the controller state file. The key index is not in a
//! snapshot: the receiver rebuilds it from the segments, so its coverage is
//! complete (DESIGN.md I3), and from `removed.keys`, the entries of keys whose
//! records retention removed and that no forget reached yet.
//!
//! Layout under a store's root: `<id>/` committed snapshots (with `meta.json`
//! written last), `CURRENT` naming the latest, `<id>.tmp/` and `incoming-*`
//! staging directories removed on open.

use std::fs;
use std::path::Path;
use std::path::PathBuf;

use crate::error::Error;
use crate::error::Result;
use crate::partition::write_file_durably;
use crate::types::SnapshotMeta;

const CURRENT_FILE: &str = "CURRENT";
const META_FILE: &str = "meta.json";

/// Held for reading while a snapshot's files are listed and opened to be sent, and for writing
/// while superseded snapshot directories are removed (a new snapshot was committed): a snapshot
/// being sent is opened whole (open files stay readable after removal) or found gone, never
/// listed half-removed. Process-wide: removals are rare and opening takes microseconds.
static REMOVAL: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// The data of a snapshot: a directory of files.
#[derive(Debug, Clone)]
pub struct SnapshotFiles {
    pub dir: PathBuf,
}

impl SnapshotFiles {
    /// Every regular file under the snapshot directory, as paths relative to it, sorted.
    pub fn list(&self) -> Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        list_into(&self.dir, Path::new(""), &mut out)?;
        out.sort();
        Ok(out)
    }

    /// Opens every file of this committed snapshot, as `list` names them, for sending. An
    /// error when the snapshot is gone or incomplete (it has no `meta.json`): a newer one
    /// replaced it, and the caller should send the current one instead.
    pub fn open_all(&self) -> Result<Vec<(PathBuf, fs::File)>> {
        let _removal = REMOVAL.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let gone = || Error::Unavailable(format!("snapshot {} was replaced by a newer one", self.dir.display()));
        let list = match self.list() {
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => return Err(gone()),
            list => list?,
        };
        if !list.iter().any(|rel| rel == Path::new(META_FILE)) {
            return Err(gone());
        }
        list.into_iter()
            .map(|rel| {
                let file = fs::File::open(self.dir.join(&rel))?;
                Ok((rel, file))
            })
            .collect()
    }
}

fn list_into(root: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(root.join(rel))? {
        let entry = entry?;
        let name = rel.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            list_into(root, &name, out)?;
        } else {
            out.push(name);
        }
    }
    Ok(())
}

/// The snapshots of one group replica.
pub struct SnapshotStore {
    root: PathBuf,
}

impl SnapshotStore {
    /// Opens the store, removing staging leftovers of a crash.
    pub fn open(root: PathBuf) -> Result<SnapshotStore> {
        fs::create_dir_all(&root)?;
        let current = read_current(&root)?;
        let _removal = REMOVAL.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        for entry in fs::read_dir(&root)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let keep = name == CURRENT_FILE || Some(&name) == current.as_ref();
            if !keep && entry.file_type()?.is_dir() {
                fs::remove_dir_all(entry.path())?;
            }
        }
        Ok(SnapshotStore { root })
    }

    /// A store whose leftovers the owning state machine already cleaned (for
    /// the receiving side, which must not remove the owner's staging dirs).
    pub fn open_existing(root: PathBuf) -> SnapshotStore {
        SnapshotStore { root }
    }

    /// A fresh staging directory for a snapshot being built.
    pub fn staging(&self, id: &str) -> Result<PathBuf> {
        let dir = self.root.join(format!("{id}.tmp"));
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// A fresh directory for a snapshot being received over the network.
    pub fn incoming(&self, id: &str) -> Result<PathBuf> {
        let safe: String = id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let dir = self.root.join(format!("incoming-{safe}-{nanos}"));
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// Makes a staged snapshot the current one (durably) and drops older ones.
    pub fn commit(&self, staged: &Path, id: &str, meta: &SnapshotMeta) -> Result<SnapshotFiles> {
        let bytes = serde_json::to_vec(meta).map_err(|e| Error::Corrupted(e.to_string()))?;
        write_file_durably(staged, META_FILE, &bytes)?;
        let dir = self.root.join(id);
        let _removal = REMOVAL.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::rename(staged, &dir)?;
        write_file_durably(&self.root, CURRENT_FILE, id.as_bytes())?;
        for entry in fs::read_dir(&self.root)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let staging = name.ends_with(".tmp") || name.starts_with("incoming-");
            if entry.file_type()?.is_dir() && name != id && !staging {
                fs::remove_dir_all(entry.path())?;
            }
        }
        Ok(SnapshotFiles { dir })
    }

    /// Copies (hard-links where possible) a snapshot received elsewhere into this store.
    pub fn adopt(&self, source: &SnapshotFiles, meta: &SnapshotMeta) -> Result<SnapshotFiles> {
        let id = new_snapshot_id(meta.last_log_id.as_ref());
        let staged = self.staging(&id)?;
        for rel in source.list()? {
            if rel == Path::new(META_FILE) {
                continue;
            }
            let dst = staged.join(&rel);
            if let Some(parent) = dst.parent() {
                fs::create_dir_all(parent)?;
            }
            let src = source.dir.join(&rel);
            if fs::hard_link(&src, &dst).is_err() {
                fs::copy(&src, &dst)?;
                fs::File::open(&dst)?.sync_all()?;
            }
        }
        self.commit(&staged, &id, meta)
    }

    /// The current snapshot, if any.
    pub fn current(&self) -> Result<Option<(SnapshotMeta, SnapshotFiles)>> {
        let Some(id) = read_current(&self.root)? else {
            return Ok(None);
        };
        let dir = self.root.join(&id);
        let bytes = match fs::read(dir.join(META_FILE)) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let meta: SnapshotMeta = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Corrupted(format!("snapshot meta {}: {e}", dir.display())))?;
        Ok(Some((meta, SnapshotFiles { dir })))
    }
}

fn read_current(root: &Path) -> Result<Option<String>> {
    match fs::read_to_string(root.join(CURRENT_FILE)) {
        Ok(s) if !s.trim().is_empty() => Ok(Some(s.trim().to_string())),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// A snapshot id unique per build: the applied log id plus a nonce.
pub fn new_snapshot_id(applied: Option<&crate::types::LogId>) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    match applied {
        Some(l) => format!("{}-{}-{nanos}", l.leader_id.term, l.index),
        None => format!("0-0-{nanos}"),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;
    use crate::types::StoredMembership;

    /// A leader sending a snapshot while it commits a newer one (which removes the older
    /// directory) either opened the older one whole before the removal, and reads it whole,
    /// or finds it gone: never a part of it.
    #[test]
    fn a_snapshot_opened_for_sending_stays_whole_after_a_newer_one_replaced_it() -> Result<()> {
        let root = tempfile::tempdir()?;
        let store = SnapshotStore::open(root.path().join("snapshots"))?;
        let meta = SnapshotMeta { last_log_id: None, last_membership: StoredMembership::default() };
        let staged = store.staging("old")?;
        fs::create_dir_all(staged.join("log"))?;
        fs::write(staged.join("log").join("00000000000000000000.log"), b"segment")?;
        fs::write(staged.join("state.json"), b"old state")?;
        let old = store.commit(&staged, "old", &meta)?;
        let opened = old.open_all()?;
        let staged = store.staging("new")?;
        fs::write(staged.join("state.json"), b"new state")?;
        store.commit(&staged, "new", &meta)?;
        assert!(!old.dir.exists(), "committing a snapshot removes the one it replaces");
        assert!(matches!(old.open_all(), Err(Error::Unavailable(_))), "a replaced snapshot cannot be opened");
        let names: Vec<PathBuf> = opened.iter().map(|(rel, _)| rel.clone()).collect();
        let expected: Vec<PathBuf> =
            ["log/00000000000000000000.log", META_FILE, "state.json"].iter().map(PathBuf::from).collect();
        assert_eq!(names, expected);
        for (rel, mut file) in opened {
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes)?;
            if rel == Path::new("state.json") {
                assert_eq!(bytes, b"old state");
            }
        }
        Ok(())
    }
}
