//! File names in a log directory and small durable-filesystem helpers.
//!
//! ```text
//! {base_offset:020}.log          segment (batches)
//! {base_offset:020}.seek         seek table of a sealed segment
//! {base_offset:020}.log.cleaned  compaction output not yet renamed over the segment
//! {base_offset:020}.seek.cleaned.tmp  its seek file, renamed over the seek file with it
//! *.tmp                          a file being written before its rename
//! ```

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use crate::Offset;
use crate::error::{Error, Result};

pub(crate) const LOG_SUFFIX: &str = ".log";
pub(crate) const SEEK_SUFFIX: &str = ".seek";
pub(crate) const CLEANED_SUFFIX: &str = ".log.cleaned";
pub(crate) const TMP_SUFFIX: &str = ".tmp";
const BASE_DIGITS: usize = 20;

/// What a directory entry of a log directory is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum EntryKind {
    Segment(Offset),
    Seek(Offset),
    /// An interrupted write (`.cleaned`, `.tmp`): removed on open.
    Leftover,
    Other,
}

/// The file name of the segment starting at `base_offset`: `{base_offset:020}.log`.
pub fn segment_file_name(base_offset: Offset) -> String {
    format!("{base_offset:020}{LOG_SUFFIX}")
}

pub(crate) fn seek_file_name(base_offset: Offset) -> String {
    format!("{base_offset:020}{SEEK_SUFFIX}")
}

pub(crate) fn segment_path(dir: &Path, base_offset: Offset) -> PathBuf {
    dir.join(segment_file_name(base_offset))
}

pub(crate) fn seek_path(dir: &Path, base_offset: Offset) -> PathBuf {
    dir.join(seek_file_name(base_offset))
}

pub(crate) fn cleaned_path(dir: &Path, base_offset: Offset) -> PathBuf {
    dir.join(format!("{base_offset:020}{CLEANED_SUFFIX}"))
}

/// The seek file of a compaction output (`B.seek.cleaned.tmp`), written before the install.
pub(crate) fn staged_seek_path(dir: &Path, base_offset: Offset) -> PathBuf {
    dir.join(format!("{base_offset:020}{SEEK_SUFFIX}.cleaned{TMP_SUFFIX}"))
}

/// `path` with `.tmp` appended.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(TMP_SUFFIX);
    PathBuf::from(name)
}

pub(crate) fn classify(name: &str) -> EntryKind {
    if name.ends_with(CLEANED_SUFFIX) || name.ends_with(TMP_SUFFIX) {
        return EntryKind::Leftover;
    }
    if let Some(base) = parse_base(name, LOG_SUFFIX) {
        return EntryKind::Segment(base);
    }
    if let Some(base) = parse_base(name, SEEK_SUFFIX) {
        return EntryKind::Seek(base);
    }
    EntryKind::Other
}

fn parse_base(name: &str, suffix: &str) -> Option<Offset> {
    let digits = name.strip_suffix(suffix)?;
    if digits.len() != BASE_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Names of the entries of `dir`, sorted.
pub(crate) fn list(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(Error::io("list", dir))? {
        let entry = entry.map_err(Error::io("list", dir))?;
        if let Some(name) = entry.file_name().to_str() {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// fsyncs a directory so entries created, renamed or removed in it are
/// durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(Error::io("fsync directory", dir))
}

pub(crate) fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io("remove", path)(e)),
        _ => Ok(()),
    }
}

/// Writes `bytes` to `path.tmp`, fsyncs it and renames it over `path`.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    let mut file = File::create(&tmp).map_err(Error::io("create", &tmp))?;
    file.write_all(bytes).map_err(Error::io("write", &tmp))?;
    file.sync_all().map_err(Error::io("fsync", &tmp))?;
    fs::rename(&tmp, path).map_err(Error::io("rename", &tmp))
}

/// The content of `path`, or `None` if it is missing or larger than
/// `bytes_max`.
pub(crate) fn read_bounded(path: &Path, bytes_max: u64) -> Result<Option<Vec<u8>>> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("open", path)(e)),
    };
    let len = file.metadata().map_err(Error::io("stat", path))?.len();
    if len > bytes_max {
        return Ok(None);
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(bytes_max + 1).read_to_end(&mut bytes).map_err(Error::io("read", path))?;
    Ok((bytes.len() as u64 <= bytes_max).then_some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_leftovers_are_recognised() {
        assert_eq!(segment_file_name(42), "00000000000000000042.log");
        assert_eq!(classify("00000000000000000042.log"), EntryKind::Segment(42));
        assert_eq!(classify("00000000000000000042.seek"), EntryKind::Seek(42));
        assert_eq!(classify("00000000000000000042.log.cleaned"), EntryKind::Leftover);
        assert_eq!(classify("00000000000000000042.seek.tmp"), EntryKind::Leftover);
        assert_eq!(classify("42.log"), EntryKind::Other);
        assert_eq!(classify("0000000000000000004x.log"), EntryKind::Other);
        assert_eq!(classify("99999999999999999999.log"), EntryKind::Other);
    }
}
