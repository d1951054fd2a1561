//! Fixed-size tables of plain values that the kernel may back with huge
//! pages: the pool's block records, the prefix index and its token copies.
//!
//! At production pool sizes those tables span tens of megabytes, and every
//! step touches a few hundred random entries of each (blocks allocated,
//! cached, looked up, freed). With 4 KiB pages nearly every such access
//! also misses the TLB, so a page walk comes on top of the cache miss;
//! 2 MiB pages cover the tables with a few dozen TLB entries. A table of at
//! least one huge page is therefore mapped on its own (anonymous memory,
//! advised `MADV_HUGEPAGE`, which Linux honours when transparent huge pages
//! are enabled as "madvise" or "always"); a smaller one, or one whose
//! mapping fails, is an ordinary `Vec`. Only the memory differs: the table
//! is a slice either way.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use memmap2::MmapMut;

/// A huge page: tables at least this large get their own mapping, which
/// starts on a multiple of it (only whole, aligned huge pages can back it).
const HUGE_PAGE: usize = 2 << 20;

/// A value that may live in a [`Table`].
///
/// # Safety
///
/// All-zero bytes must be a valid value (anonymous memory starts zeroed),
/// and the alignment must be at most a page's: plain structs of integers
/// and `bool`s qualify.
pub(super) unsafe trait Plain: Copy {}

// SAFETY: an integer; 4-byte alignment.
unsafe impl Plain for u32 {}

pub(super) struct Table<T: Plain> {
    storage: Storage<T>,
}

enum Storage<T> {
    Heap(Vec<T>),
    /// `len` values from byte `offset` of `map`.
    Mapped {
        map: MmapMut,
        offset: usize,
        len: usize,
        _values: PhantomData<T>,
    },
}

impl<T: Plain> Table<T> {
    /// `len` copies of `value`.
    pub(super) fn new(len: usize, value: T) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        if bytes >= HUGE_PAGE {
            // One huge page more than needed, so that the table can start
            // on a huge-page boundary (the pages around it are never touched).
            if let Ok(map) = MmapMut::map_anon(bytes + HUGE_PAGE) {
                // A hint: without transparent huge pages the table still works.
                #[cfg(target_os = "linux")]
                let _ = map.advise(memmap2::Advice::HugePage);
                let offset = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
                let mut table = Table {
                    storage: Storage::Mapped {
                        map,
                        offset,
                        len,
                        _values: PhantomData,
                    },
                };
                table.fill(value);
                return table;
            }
        }
        Table {
            storage: Storage::Heap(vec![value; len]),
        }
    }
}

impl<T: Plain> Deref for Table<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Heap(v) => v,
            // SAFETY: `offset` is page aligned (enough for `T: Plain`) and
            // `offset + len * size_of::<T>()` is within the mapping, which
            // is initialised (zeroed by the kernel, then filled) and lives as
            // long as `self`; all-zero bytes are a valid `T` (`Plain`).
            Storage::Mapped {
                map, offset, len, ..
            } => unsafe { std::slice::from_raw_parts(map.as_ptr().add(*offset).cast::<T>(), *len) },
        }
    }
}

impl<T: Plain> DerefMut for Table<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Heap(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
            Storage::Mapped {
                map, offset, len, ..
            } => unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(*offset).cast::<T>(), *len)
            },
        }
    }
}

impl<T: Plain + std::fmt::Debug> std::fmt::Debug for Table<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mapped = matches!(self.storage, Storage::Mapped { .. });
        f.debug_struct("Table")
            .field("len", &self.len())
            .field("mapped", &mapped)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_tables_are_vecs_large_ones_mapped_and_both_hold_the_value() {
        let small = Table::new(10, 7u32);
        assert!(matches!(small.storage, Storage::Heap(_)));
        assert!(small.iter().all(|&x| x == 7));
        let n = HUGE_PAGE / 4 + 3;
        let mut large = Table::new(n, 9u32);
        assert!(matches!(large.storage, Storage::Mapped { .. }));
        assert_eq!(
            large.as_ptr() as usize % HUGE_PAGE,
            0,
            "starts on a huge page"
        );
        assert_eq!(large.len(), n);
        assert!(large.iter().all(|&x| x == 9));
        large[n - 1] = 1;
        assert_eq!(large[n - 1], 1);
    }
}
