//! A6: admission counters shared by the gRPC frontend processes.
//!
//! With K frontends the global `max_num_queued_reqs` (A2) is checked against
//! the sum of every frontend's in-flight count. The launcher [`create`]s one
//! shared-memory segment before forking the frontends; frontend `i`
//! [`open`]s slot `i`, writes only that slot and reads the sum of all slots.
//! Each slot is a whole cache line, so frontends never write the same line
//! and there are no locks on the request path: an admission is one atomic add
//! and K loads.
//!
//! Layout of the file (native byte order, the segment never leaves the host):
//!
//! ```text
//! offset 0    header, 64 bytes
//!             0  magic         u64   b"FSADMIT\0", written last
//!             8  version       u32   [`VERSION`]
//!             12 num_slots     u32
//!             16 creator_pid   u32
//!             24 creator_start u64   creator's start time (clock ticks
//!                                    since boot, /proc/<pid>/stat field 22)
//! offset 64   num_slots × 64-byte slots; slot i's first 8 bytes are an
//!             AtomicI64, the other 56 are padding
//! ```
//!
//! Linux only in practice: segments live in `/dev/shm` (tmpfs), and whether a
//! creator is still alive is read from `/proc`. Where `/proc` is missing every
//! creator counts as alive, so an existing segment is never removed blindly.
//!
//! [`create`]: SharedAdmissionStats::create
//! [`open`]: SharedAdmissionStats::open

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use memmap2::MmapRaw;

use crate::error::{Error, Result};

/// Where segments live unless a directory is given: tmpfs, so the counters
/// never touch a disk.
pub const DEFAULT_DIR: &str = "/dev/shm";
/// Bumped whenever the layout changes; `open` refuses another version.
pub const VERSION: u32 = 1;
/// Enough for any plausible number of frontend processes on one host.
pub const MAX_SLOTS: usize = 4096;

const MAGIC: u64 = u64::from_ne_bytes(*b"FSADMIT\0");
const HEADER_BYTES: usize = 64;
const SLOT_BYTES: usize = 64;
const NAME_MAX: usize = 255;

/// One frontend's counter, alone on its cache line so that frontends adding
/// to their own slots never contend for the same line.
#[repr(C, align(64))]
struct Slot {
    in_flight: AtomicI64,
}

const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_BYTES);

/// The header as read back from a segment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    magic: u64,
    version: u32,
    num_slots: u32,
    creator_pid: u32,
    creator_start: u64,
}

impl Header {
    fn to_bytes(self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&self.magic.to_ne_bytes());
        b[8..12].copy_from_slice(&self.version.to_ne_bytes());
        b[12..16].copy_from_slice(&self.num_slots.to_ne_bytes());
        b[16..20].copy_from_slice(&self.creator_pid.to_ne_bytes());
        b[24..32].copy_from_slice(&self.creator_start.to_ne_bytes());
        b
    }

    fn from_bytes(b: &[u8; HEADER_BYTES]) -> Self {
        let u64_at = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Header {
            magic: u64_at(0),
            version: u32_at(8),
            num_slots: u32_at(12),
            creator_pid: u32_at(16),
            creator_start: u64_at(24),
        }
    }

    /// Reads the header, or `None` when the file is shorter than one (a
    /// creator that died between creating the file and writing it).
    fn read(file: &File) -> std::io::Result<Option<Self>> {
        let mut b = [0u8; HEADER_BYTES];
        match file.read_exact_at(&mut b, 0) {
            Ok(()) => Ok(Some(Header::from_bytes(&b))),
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A handle on a shared admission segment: the creator's (no slot; unlinks
/// the file when dropped) or a frontend's (one slot it writes).
#[derive(Debug)]
pub struct SharedAdmissionStats {
    name: String,
    path: PathBuf,
    slot: Option<usize>,
    num_slots: usize,
    /// Device and inode of the file we mapped, so `unlink` never removes a
    /// newer segment that replaced ours under the same name.
    file_id: (u64, u64),
    unlinked: AtomicBool,
    map: MmapRaw,
}

impl SharedAdmissionStats {
    /// Creates segment `name` in [`DEFAULT_DIR`] with `num_slots` zeroed slots.
    pub fn create(name: &str, num_slots: usize) -> Result<Self> {
        Self::create_in(DEFAULT_DIR, name, num_slots)
    }

    /// Creates segment `name` in `dir`, mode 0600, failing if it exists
    /// (O_EXCL) — unless the existing segment's creator is dead, in which case
    /// it is a leftover of a crashed run and is replaced.
    pub fn create_in(dir: impl AsRef<Path>, name: &str, num_slots: usize) -> Result<Self> {
        validate_name(name)?;
        if num_slots == 0 || num_slots > MAX_SLOTS {
            return Err(Error::InvalidConfig(format!(
                "shared admission segment {name:?}: num_slots ({num_slots}) must be in [1, {MAX_SLOTS}]"
            )));
        }
        let path = dir.as_ref().join(name);
        let len = segment_len(num_slots);
        // Two tries: the second follows the removal of a stale segment.
        for _ in 0..2 {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(file) => return Self::initialise(name, path, file, num_slots, len),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => remove_if_stale(name, &path)?,
                Err(e) => return Err(io_error(name, &path, "create", e)),
            }
        }
        Err(Error::SharedMemory(format!(
            "shared admission segment {name:?} ({}) was recreated by another process while \
             replacing a stale one; is another launcher using the same name?",
            path.display()
        )))
    }

    fn initialise(
        name: &str,
        path: PathBuf,
        file: File,
        num_slots: usize,
        len: u64,
    ) -> Result<Self> {
        let init = || -> std::io::Result<(MmapRaw, (u64, u64))> {
            // The umask may have narrowed the mode but never widens it; set
            // it explicitly so the segment is exactly 0600 either way.
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
            file.set_len(len)?; // tmpfs zero-fills: every slot starts at 0
            let header = Header {
                magic: 0,
                version: VERSION,
                num_slots: num_slots as u32,
                creator_pid: std::process::id(),
                creator_start: process_start_time(std::process::id()).unwrap_or(0),
            };
            // Magic last: an `open` that sees it sees the rest of the header.
            file.write_all_at(&header.to_bytes(), 0)?;
            file.write_all_at(&MAGIC.to_ne_bytes(), 0)?;
            let meta = file.metadata()?;
            Ok((MmapRaw::map_raw(&file)?, (meta.dev(), meta.ino())))
        };
        match init() {
            Ok((map, file_id)) => Ok(SharedAdmissionStats {
                name: name.to_owned(),
                path,
                slot: None,
                num_slots,
                file_id,
                unlinked: AtomicBool::new(false),
                map,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(io_error(name, &path, "initialise", e))
            }
        }
    }

    /// Attaches a frontend to slot `slot` of segment `name` in [`DEFAULT_DIR`].
    pub fn open(name: &str, slot: usize) -> Result<Self> {
        Self::open_in(DEFAULT_DIR, name, slot)
    }

    /// Attaches a frontend to slot `slot` of segment `name` in `dir`, after
    /// checking the header (magic, version, num_slots, file size).
    ///
    /// The slot is claimed: its counter is reset to 0, because the opener is
    /// its only writer and has nothing in flight yet. A frontend restarted
    /// after a crash thus does not inherit its predecessor's count, which
    /// would otherwise shrink the global limit for good.
    pub fn open_in(dir: impl AsRef<Path>, name: &str, slot: usize) -> Result<Self> {
        validate_name(name)?;
        let path = dir.as_ref().join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_error(name, &path, "open", e))?;
        let bad = |why: String| {
            Error::SharedMemory(format!(
                "shared admission segment {name:?} ({}) {why}",
                path.display()
            ))
        };
        let header = Header::read(&file)
            .map_err(|e| io_error(name, &path, "read", e))?
            .ok_or_else(|| bad("is shorter than its header".into()))?;
        if header.magic != MAGIC {
            return Err(bad(
                "is not an initialised fastsched admission segment (bad magic)".into(),
            ));
        }
        if header.version != VERSION {
            return Err(bad(format!(
                "has layout version {}, this build reads version {VERSION}",
                header.version
            )));
        }
        let num_slots = header.num_slots as usize;
        if num_slots == 0 || num_slots > MAX_SLOTS {
            return Err(bad(format!(
                "records num_slots {num_slots}, outside [1, {MAX_SLOTS}]"
            )));
        }
        if slot >= num_slots {
            return Err(Error::InvalidConfig(format!(
                "shared admission segment {name:?}: slot {slot} is out of range, it has {num_slots} slots"
            )));
        }
        let meta = file
            .metadata()
            .map_err(|e| io_error(name, &path, "stat", e))?;
        // A short file would turn slot accesses past its end into SIGBUS.
        if meta.len() < segment_len(num_slots) {
            return Err(bad(format!(
                "is {} bytes, {num_slots} slots need {}",
                meta.len(),
                segment_len(num_slots)
            )));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| io_error(name, &path, "mmap", e))?;
        let stats = SharedAdmissionStats {
            name: name.to_owned(),
            path,
            slot: Some(slot),
            num_slots,
            file_id: (meta.dev(), meta.ino()),
            unlinked: AtomicBool::new(false),
            map,
        };
        stats.counter(slot).store(0, Ordering::SeqCst);
        Ok(stats)
    }

    /// Adds `delta` to this frontend's counter: `+n` when `n` requests are
    /// admitted, `-1` when one finishes or is aborted.
    ///
    /// Orderings: the counter publishes no other data, so Relaxed would keep
    /// each sum exact. SeqCst is used (here, in `set` and in `total`) so that
    /// "add, then check `total()`, undo on overflow" is race-free across
    /// frontends: two frontends reserving at once cannot both miss the other's
    /// add (the store-buffer pattern, which AcqRel/Acquire would allow). It
    /// costs nothing extra: x86 `lock xadd` is a full fence anyway and SeqCst
    /// loads are plain loads on x86 and `ldar` (as Acquire) on aarch64.
    pub fn add(&self, delta: i64) -> Result<()> {
        self.counter(self.own_slot()?)
            .fetch_add(delta, Ordering::SeqCst);
        Ok(())
    }

    /// Sets this frontend's counter, e.g. to its exact unfinished count.
    pub fn set(&self, value: i64) -> Result<()> {
        self.counter(self.own_slot()?)
            .store(value, Ordering::SeqCst);
        Ok(())
    }

    /// This frontend's counter.
    pub fn own(&self) -> Result<i64> {
        Ok(self.counter(self.own_slot()?).load(Ordering::SeqCst))
    }

    /// The in-flight count of all frontends together (A2): the sum of every
    /// slot. Each load is atomic; the sum is not a snapshot, which is fine for
    /// a limit that is checked per request.
    pub fn total(&self) -> i64 {
        (0..self.num_slots)
            .map(|i| self.counter(i).load(Ordering::SeqCst))
            .fold(0i64, i64::wrapping_add)
    }

    /// Removes the segment's file. Processes that have it mapped keep working
    /// on their mapping; a later `open` fails and a later `create` makes a new
    /// segment. Idempotent, and a no-op if the name now refers to another
    /// segment. The creator's handle calls this when dropped.
    pub fn unlink(&self) -> Result<()> {
        if self.unlinked.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        match std::fs::metadata(&self.path) {
            Ok(meta) if (meta.dev(), meta.ino()) == self.file_id => {}
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error(&self.name, &self.path, "stat", e)),
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_error(&self.name, &self.path, "unlink", e)),
        }
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// This frontend's slot; `None` for the creator's handle.
    pub fn slot(&self) -> Option<usize> {
        self.slot
    }

    fn own_slot(&self) -> Result<usize> {
        self.slot.ok_or_else(|| {
            Error::SharedMemory(format!(
                "shared admission segment {:?}: the creator's handle has no slot of its own; \
                 a frontend attaches with open(name, slot)",
                self.name
            ))
        })
    }

    fn counter(&self, slot: usize) -> &AtomicI64 {
        assert!(slot < self.num_slots, "slot {slot} out of range");
        // SAFETY: the mapping is page aligned and at least
        // `segment_len(num_slots)` bytes (checked at open, set at create), so
        // slot `slot` is an aligned, in-bounds `Slot` that lives as long as
        // `self.map`. All access to slots is atomic, so concurrent writers in
        // this or other processes are fine. Truncating the file under a live
        // mapping (only possible by hand) would raise SIGBUS.
        unsafe {
            let slots = self.map.as_mut_ptr().add(HEADER_BYTES) as *const Slot;
            &(*slots.add(slot)).in_flight
        }
    }
}

impl Drop for SharedAdmissionStats {
    fn drop(&mut self) {
        if self.slot.is_none() {
            let _ = self.unlink();
        }
    }
}

fn segment_len(num_slots: usize) -> u64 {
    (HEADER_BYTES + num_slots * SLOT_BYTES) as u64
}

/// Names become file names: a conservative character set keeps them inside
/// the directory (no '/', no "." or "..") and portable.
fn validate_name(name: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty()
        || name.len() > NAME_MAX
        || !name.chars().all(ok_char)
        || name.chars().all(|c| c == '.')
    {
        return Err(Error::InvalidConfig(format!(
            "shared admission segment name {name:?} must be 1 to {NAME_MAX} ASCII letters, \
             digits, '-', '_' or '.', and not only dots"
        )));
    }
    Ok(())
}

/// Removes the existing segment at `path` if its creator is dead; errors if
/// the creator is alive or the file cannot be identified as a segment.
fn remove_if_stale(name: &str, path: &Path) -> Result<()> {
    let file = match File::open(path) {
        Ok(f) => f,
        // Removed between our create attempt and now: just try again.
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(name, path, "open existing", e)),
    };
    let header = Header::read(&file).map_err(|e| io_error(name, path, "read existing", e))?;
    let header = match header {
        Some(h) if h.magic == MAGIC => h,
        // Unrecognisable, or a creator still writing its header: never
        // remove what we cannot prove is ours and abandoned.
        _ => {
            return Err(Error::SharedMemory(format!(
                "shared admission segment {name:?}: {} exists but is not an initialised \
                 fastsched admission segment; remove it if no server uses it",
                path.display()
            )))
        }
    };
    if creator_alive(header.creator_pid, header.creator_start) {
        return Err(Error::SharedMemory(format!(
            "shared admission segment {name:?}: {} is in use by live process {} \
             (another server with the same segment name?)",
            path.display(),
            header.creator_pid
        )));
    }
    // Remove only the file we inspected, not one another launcher just made.
    let inspected = file
        .metadata()
        .map_err(|e| io_error(name, path, "stat existing", e))?;
    match std::fs::metadata(path) {
        Ok(now) if (now.dev(), now.ino()) == (inspected.dev(), inspected.ino()) => {}
        _ => return Ok(()),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(name, path, "remove stale", e)),
    }
}

/// Whether the process that created a segment is still running. A PID that
/// exists but started at another time than recorded was reused: the creator
/// is dead. Without `/proc` (not Linux) every creator counts as alive.
fn creator_alive(pid: u32, recorded_start: u64) -> bool {
    if !Path::new("/proc/self").exists() {
        return true;
    }
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return false;
    }
    match (recorded_start, process_start_time(pid)) {
        (0, _) | (_, None) => true,
        (recorded, Some(now)) => recorded == now,
    }
}

/// Field 22 of `/proc/<pid>/stat`: the process's start time in clock ticks
/// since boot. Together with the PID it names a process uniquely.
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 (comm) may contain spaces and ')', so count from the last ')'.
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // after_comm starts with field 3 (state), so field 22 is the 20th.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

fn io_error(name: &str, path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::SharedMemory(format!(
        "shared admission segment {name:?}: cannot {what} {}: {e}",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::AtomicU64;

    /// A name no other test or run uses; the creator handle unlinks it on drop.
    fn unique_name(what: &str) -> String {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!(
            "fastsched-test-{what}-{}-{nanos}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id();
        child.wait().expect("wait true");
        pid
    }

    /// Leaves a segment behind as a crashed launcher would: created, then
    /// abandoned without unlink, with `pid`/`start` as its recorded creator.
    fn leave_segment(name: &str, num_slots: usize, pid: u32, start: u64) -> PathBuf {
        let stats = SharedAdmissionStats::create(name, num_slots).expect("create");
        let path = stats.path().to_owned();
        let file = OpenOptions::new().write(true).open(&path).expect("open");
        file.write_all_at(&pid.to_ne_bytes(), 16)
            .expect("write pid");
        file.write_all_at(&start.to_ne_bytes(), 24)
            .expect("write start");
        std::mem::forget(stats);
        path
    }

    #[test]
    fn a6_total_sums_every_frontend_slot() {
        let name = unique_name("total");
        let creator = SharedAdmissionStats::create(&name, 3).unwrap();
        let f0 = SharedAdmissionStats::open(&name, 0).unwrap();
        let f2 = SharedAdmissionStats::open(&name, 2).unwrap();
        f0.add(5).unwrap();
        f2.add(7).unwrap();
        f0.add(-2).unwrap();
        assert_eq!(f0.own().unwrap(), 3);
        assert_eq!(f2.own().unwrap(), 7);
        assert_eq!(f0.total(), 10);
        assert_eq!(f2.total(), 10);
        assert_eq!(creator.total(), 10);
        f2.set(1).unwrap();
        assert_eq!(creator.total(), 4);
        assert_eq!((creator.num_slots(), f2.num_slots()), (3, 3));
        assert_eq!((creator.slot(), f2.slot()), (None, Some(2)));
    }

    #[test]
    fn a6_concurrent_adds_from_many_threads_sum_exactly() {
        let name = unique_name("threads");
        let creator = SharedAdmissionStats::create(&name, 4).unwrap();
        std::thread::scope(|s| {
            for slot in 0..4 {
                let name = &name;
                s.spawn(move || {
                    let f = SharedAdmissionStats::open(name, slot).unwrap();
                    for i in 0..100_000 {
                        f.add(if i % 4 == 3 { -1 } else { 1 }).unwrap();
                    }
                });
            }
        });
        assert_eq!(creator.total(), 4 * 50_000);
    }

    #[test]
    fn a6_concurrent_adds_on_one_slot_sum_exactly() {
        let name = unique_name("oneslot");
        let _creator = SharedAdmissionStats::create(&name, 1).unwrap();
        let f = SharedAdmissionStats::open(&name, 0).unwrap();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..50_000 {
                        f.add(1).unwrap();
                    }
                });
            }
        });
        assert_eq!(f.own().unwrap(), 8 * 50_000);
    }

    #[test]
    fn a6_segment_file_is_mode_0600_and_sized_for_its_slots() {
        let name = unique_name("perms");
        let creator = SharedAdmissionStats::create(&name, 5).unwrap();
        let meta = std::fs::metadata(creator.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.len(), 64 + 5 * 64);
        assert_eq!(creator.path(), Path::new("/dev/shm").join(&name));
    }

    #[test]
    fn a6_create_in_a_given_directory() {
        let name = unique_name("dir");
        let dir = std::env::temp_dir();
        let creator = SharedAdmissionStats::create_in(&dir, &name, 2).unwrap();
        let f = SharedAdmissionStats::open_in(&dir, &name, 1).unwrap();
        f.add(3).unwrap();
        assert_eq!(creator.total(), 3);
        assert!(dir.join(&name).exists());
        drop(creator);
        assert!(!dir.join(&name).exists());
    }

    #[test]
    fn a6_stale_segment_of_a_dead_creator_is_replaced() {
        let name = unique_name("stale");
        let path = leave_segment(&name, 2, dead_pid(), 0);
        {
            let f = SharedAdmissionStats::open(&name, 1).unwrap();
            f.add(9).unwrap(); // the crashed run's leftover count
        }
        let creator = SharedAdmissionStats::create(&name, 3).unwrap();
        assert_eq!(creator.num_slots(), 3);
        assert_eq!(creator.total(), 0, "a fresh segment, not the stale one");
        assert!(path.exists());
    }

    #[test]
    fn a6_segment_whose_pid_was_reused_by_another_process_is_stale() {
        let name = unique_name("reused");
        // Our own, live PID but another start time: the PID was reused.
        let start = process_start_time(std::process::id()).unwrap();
        leave_segment(&name, 1, std::process::id(), start + 1);
        let creator = SharedAdmissionStats::create(&name, 1).unwrap();
        assert_eq!(creator.total(), 0);
    }

    #[test]
    fn a6_create_errors_while_the_creator_is_alive() {
        let name = unique_name("live");
        let first = SharedAdmissionStats::create(&name, 2).unwrap();
        let err = SharedAdmissionStats::create(&name, 2).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::SharedMemory(_)), "{err:?}");
        assert!(msg.contains(&name) && msg.contains("live process"), "{msg}");
        assert!(msg.contains(&std::process::id().to_string()), "{msg}");
        // The failed create left the first segment intact.
        assert!(first.path().exists());
        let f = SharedAdmissionStats::open(&name, 1).unwrap();
        f.add(1).unwrap();
        assert_eq!(first.total(), 1);
    }

    #[test]
    fn a6_create_refuses_to_remove_a_file_that_is_not_a_segment() {
        let name = unique_name("foreign");
        let path = Path::new(DEFAULT_DIR).join(&name);
        std::fs::write(&path, b"not ours").unwrap();
        let err = SharedAdmissionStats::create(&name, 1).unwrap_err();
        let kept = std::fs::read(&path);
        std::fs::remove_file(&path).unwrap();
        assert!(err.to_string().contains("not an initialised"), "{err}");
        assert_eq!(kept.unwrap(), b"not ours");
    }

    #[test]
    fn a6_bad_names_are_rejected_naming_the_value() {
        let long = "a".repeat(256);
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../etc",
            "sp ace",
            "ünï",
            long.as_str(),
        ] {
            let err = SharedAdmissionStats::create(bad, 1).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig(_)), "{bad:?}: {err:?}");
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
            assert!(SharedAdmissionStats::open(bad, 0).is_err());
        }
        assert!(validate_name("fastsched.admission_1-a").is_ok());
    }

    #[test]
    fn a6_bad_slot_and_num_slots_are_rejected() {
        let name = unique_name("slots");
        let creator = SharedAdmissionStats::create(&name, 2).unwrap();
        let err = SharedAdmissionStats::open(&name, 2).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
        assert!(err.to_string().contains("slot 2"), "{err}");
        assert!(err.to_string().contains("2 slots"), "{err}");
        for n in [0, MAX_SLOTS + 1] {
            let err = SharedAdmissionStats::create(&unique_name("n"), n).unwrap_err();
            assert!(
                err.to_string().contains(&format!("num_slots ({n})")),
                "{err}"
            );
        }
        drop(creator);
    }

    #[test]
    fn a6_open_rejects_missing_and_malformed_segments() {
        let err = SharedAdmissionStats::open(&unique_name("missing"), 0).unwrap_err();
        assert!(matches!(err, Error::SharedMemory(_)) && err.to_string().contains("cannot open"));

        let name = unique_name("version");
        let creator = SharedAdmissionStats::create(&name, 1).unwrap();
        let file = OpenOptions::new().write(true).open(creator.path()).unwrap();
        file.write_all_at(&(VERSION + 1).to_ne_bytes(), 8).unwrap();
        let err = SharedAdmissionStats::open(&name, 0).unwrap_err();
        assert!(err.to_string().contains("layout version"), "{err}");

        file.write_all_at(&VERSION.to_ne_bytes(), 8).unwrap();
        file.set_len(64 + 32).unwrap();
        let err = SharedAdmissionStats::open(&name, 0).unwrap_err();
        assert!(err.to_string().contains("bytes"), "{err}");
    }

    #[test]
    fn a6_creator_handle_has_no_slot_to_write() {
        let name = unique_name("noslot");
        let creator = SharedAdmissionStats::create(&name, 1).unwrap();
        assert!(creator.add(1).is_err());
        assert!(creator.set(1).is_err());
        assert!(creator.own().is_err());
    }

    #[test]
    fn a6_open_claims_the_slot_from_a_crashed_predecessor() {
        let name = unique_name("claim");
        let creator = SharedAdmissionStats::create(&name, 2).unwrap();
        let crashed = SharedAdmissionStats::open(&name, 1).unwrap();
        crashed.add(4).unwrap();
        std::mem::forget(crashed);
        let restarted = SharedAdmissionStats::open(&name, 1).unwrap();
        assert_eq!(restarted.own().unwrap(), 0);
        assert_eq!(creator.total(), 0);
    }

    #[test]
    fn a6_unlink_removes_the_file_and_mappings_keep_working() {
        let name = unique_name("unlink");
        let creator = SharedAdmissionStats::create(&name, 1).unwrap();
        let f = SharedAdmissionStats::open(&name, 0).unwrap();
        creator.unlink().unwrap();
        assert!(!creator.path().exists());
        creator.unlink().unwrap(); // idempotent
        f.add(2).unwrap();
        assert_eq!(creator.total(), 2);
        assert!(SharedAdmissionStats::open(&name, 0).is_err());
    }

    #[test]
    fn a6_dropping_the_creator_unlinks_but_dropping_a_frontend_does_not() {
        let name = unique_name("drop");
        let creator = SharedAdmissionStats::create(&name, 1).unwrap();
        let path = creator.path().to_owned();
        drop(SharedAdmissionStats::open(&name, 0).unwrap());
        assert!(path.exists());
        drop(creator);
        assert!(!path.exists());
    }

    #[test]
    fn a6_unlink_leaves_a_newer_segment_of_the_same_name_alone() {
        let name = unique_name("newer");
        let old = SharedAdmissionStats::create(&name, 1).unwrap();
        std::fs::remove_file(old.path()).unwrap();
        let new = SharedAdmissionStats::create(&name, 1).unwrap();
        drop(old);
        assert!(new.path().exists());
    }

    #[test]
    fn a6_process_start_time_reads_proc_stat() {
        assert!(process_start_time(std::process::id()).is_some());
        assert!(!creator_alive(dead_pid(), 0));
        assert!(creator_alive(std::process::id(), 0));
    }
}
