//! Checkpoints (hard links of immutable segment files) and installs
//! (replacing a log directory by checkpoint files, atomically).
//!
//! Install protocol for log directory `D` with files from `F`:
//! 1. `D.install-staging` is created; sealed segments and their seek files
//!    from `F` are hard-linked (or copied across file systems), the last
//!    segment is copied (it becomes active and is appended to); every file
//!    and the directory are fsynced;
//! 2. the marker `D.install-staging/INSTALL_COMPLETE` is written and
//!    fsynced;
//! 3. `D` is renamed to `D.install-old`, `D.install-staging` to `D`, the
//!    parent directory fsynced; the marker and `D.install-old` are removed.
//!
//! `Log::open(D)` first finishes an interrupted install: a staging
//! directory with the marker replaces a missing `D`; otherwise staging is
//! discarded (the old log stays); `D.install-old` is removed once `D`
//! exists. So a crash leaves the old log or the new one, never neither.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use tracing::info;

use crate::Offset;
use crate::error::{Error, Result};
use crate::files::{self, EntryKind};
use crate::segment::Segment;

const MARKER: &str = "INSTALL_COMPLETE";

/// Hard-links every sealed segment (and seek file) into `dst` and creates an
/// empty file named like the (empty) active segment.
pub(crate) fn link_segments(dir: &Path, segments: &[Segment], dst: &Path) -> Result<Vec<PathBuf>> {
    fs::create_dir_all(dst).map_err(Error::io("create directory", dst))?;
    let Some((active, sealed)) = segments.split_last() else {
        return Ok(Vec::new());
    };
    assert!(active.is_empty(), "checkpoint links only sealed segments; the active one must be empty");
    let mut paths = Vec::with_capacity(2 * segments.len());
    for segment in sealed {
        let target = dst.join(files::segment_file_name(segment.base_offset));
        fs::hard_link(&segment.path, &target).map_err(Error::io("link", &target))?;
        paths.push(target);
        let seek = files::seek_path(dir, segment.base_offset);
        if seek.exists() {
            let target = dst.join(files::seek_file_name(segment.base_offset));
            fs::hard_link(&seek, &target).map_err(Error::io("link", &target))?;
            paths.push(target);
        }
    }
    let target = dst.join(files::segment_file_name(active.base_offset));
    File::create(&target).and_then(|f| f.sync_all()).map_err(Error::io("create", &target))?;
    paths.push(target);
    files::sync_dir(dst)?;
    info!(dst = %dst.display(), files = paths.len(), "checkpoint linked");
    Ok(paths)
}

/// Replaces `dir` by the segment files of `files_dir` (protocol above).
pub(crate) fn install(dir: &Path, files_dir: &Path) -> Result<()> {
    let (segments, seeks) = source_files(files_dir)?;
    let (staging, old) = (sibling(dir, "install-staging")?, sibling(dir, "install-old")?);
    remove_dir_if_exists(&staging)?;
    fs::create_dir_all(&staging).map_err(Error::io("create directory", &staging))?;
    let active = segments.last().copied();
    for &base in &segments {
        let name = files::segment_file_name(base);
        stage(&files_dir.join(&name), &staging.join(&name), Some(base) != active)?;
    }
    for base in seeks.into_iter().filter(|b| segments.contains(b) && Some(*b) != active) {
        let name = files::seek_file_name(base);
        stage(&files_dir.join(&name), &staging.join(&name), true)?;
    }
    let marker = staging.join(MARKER);
    File::create(&marker).and_then(|f| f.sync_all()).map_err(Error::io("create", &marker))?;
    files::sync_dir(&staging)?;
    swap(dir, &staging, &old)?;
    info!(dir = %dir.display(), segments = segments.len(), "log installed");
    Ok(())
}

/// Reads every segment file of `files_dir` whole (see `Log::verify_files`).
pub(crate) fn verify(files_dir: &Path) -> Result<Offset> {
    let (segments, _) = source_files(files_dir)?;
    let mut next_offset = 0;
    for (i, &base) in segments.iter().enumerate() {
        let end = Segment::verify_file(files_dir, base)?;
        if let Some(&next_base) = segments.get(i + 1)
            && end > next_base
        {
            return Err(Error::Corrupt {
                path: files::segment_path(files_dir, base),
                base_offset: base,
                position: 0,
                source: Box::new(Error::malformed("segment overlaps the next segment", 0)),
            });
        }
        next_offset = end;
    }
    Ok(next_offset)
}

/// Finishes or discards an install interrupted by a crash.
pub(crate) fn finish_interrupted_install(dir: &Path) -> Result<()> {
    let (Ok(staging), Ok(old)) = (sibling(dir, "install-staging"), sibling(dir, "install-old")) else {
        return Ok(());
    };
    if !dir.exists() && staging.join(MARKER).exists() {
        info!(dir = %dir.display(), "finishing an interrupted install");
        rename(&staging, dir)?;
    }
    if !dir.exists() && old.exists() {
        rename(&old, dir)?;
    }
    remove_dir_if_exists(&staging)?;
    if dir.exists() {
        remove_dir_if_exists(&old)?;
        files::remove_if_exists(&dir.join(MARKER))?;
    }
    Ok(())
}

/// Sorted segment and seek base offsets in `files_dir`; anything else is
/// refused.
fn source_files(files_dir: &Path) -> Result<(Vec<Offset>, Vec<Offset>)> {
    let mut segments = Vec::new();
    let mut seeks = Vec::new();
    for name in files::list(files_dir)? {
        match files::classify(&name) {
            EntryKind::Segment(base) => segments.push(base),
            EntryKind::Seek(base) => seeks.push(base),
            EntryKind::Leftover | EntryKind::Other => {
                return Err(Error::InvalidInstallSource {
                    path: files_dir.join(name),
                    reason: "not a segment or seek file",
                });
            }
        }
    }
    if segments.is_empty() {
        return Err(Error::InvalidInstallSource { path: files_dir.to_path_buf(), reason: "no segment files" });
    }
    segments.sort_unstable();
    Ok((segments, seeks))
}

/// Links (or copies) `src` to `dst` and fsyncs it; `link = false` always
/// copies.
fn stage(src: &Path, dst: &Path, link: bool) -> Result<()> {
    let linked = link && fs::hard_link(src, dst).is_ok();
    if !linked {
        fs::copy(src, dst).map_err(Error::io("copy", src))?;
    }
    File::open(dst).and_then(|f| f.sync_all()).map_err(Error::io("fsync", dst))
}

fn swap(dir: &Path, staging: &Path, old: &Path) -> Result<()> {
    if dir.exists() {
        remove_dir_if_exists(old)?;
        rename(dir, old)?;
    }
    rename(staging, dir)?;
    files::remove_if_exists(&dir.join(MARKER))?;
    remove_dir_if_exists(old)?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        files::sync_dir(parent)?;
    }
    Ok(())
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).map_err(Error::io("rename", from))?;
    if let Some(parent) = to.parent().filter(|p| !p.as_os_str().is_empty()) {
        files::sync_dir(parent)?;
    }
    Ok(())
}

/// `dir` with `.{suffix}` appended to its last component.
fn sibling(dir: &Path, suffix: &str) -> Result<PathBuf> {
    let name = dir.file_name().ok_or_else(|| Error::InvalidInstallSource {
        path: dir.to_path_buf(),
        reason: "the log directory path has no final component",
    })?;
    let mut name = name.to_owned();
    name.push(".");
    name.push(suffix);
    Ok(dir.with_file_name(name))
}

fn remove_dir_if_exists(path: &Path) -> Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io("remove directory", path)(e)),
        _ => Ok(()),
    }
}
