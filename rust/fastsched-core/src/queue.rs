//! Waiting queues (S14): an FCFS deque and a priority heap behind one trait.

use std::cmp::Ordering;
use std::collections::{BTreeSet, VecDeque};

use crate::config::Policy;
use crate::request::{Handle, Request};

/// What a queue needs to know of a request to order it.
#[derive(Debug, Clone)]
pub struct QueueEntry {
    pub handle: Handle,
    pub priority: i64,
    pub arrival_time: f64,
    pub request_id: String,
}

impl QueueEntry {
    pub fn of(req: &Request) -> Self {
        QueueEntry {
            handle: req.handle,
            priority: req.priority,
            arrival_time: req.arrival_time,
            request_id: req.request_id.clone(),
        }
    }
}

pub trait RequestQueue: Send + Sync {
    /// A new arrival.
    fn push(&mut self, entry: QueueEntry);
    /// A request going back (preempted, or deferred by S7): FCFS puts it at
    /// the front, priority simply inserts it.
    fn prepend(&mut self, entry: QueueEntry);
    /// Puts several requests back at the head keeping their relative order.
    fn prepend_all(&mut self, entries: Vec<QueueEntry>);
    fn peek(&self) -> Option<Handle>;
    fn pop(&mut self) -> Option<Handle>;
    fn remove(&mut self, handle: Handle) -> bool;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Handles in scheduling order (for diagnostics and tests; not per step).
    fn ordered(&self) -> Vec<Handle>;
}

pub fn new_queue(policy: Policy) -> Box<dyn RequestQueue> {
    match policy {
        Policy::Fcfs => Box::new(FcfsQueue::default()),
        Policy::Priority => Box::new(PriorityQueue::default()),
    }
}

#[derive(Debug, Default)]
pub struct FcfsQueue {
    deque: VecDeque<Handle>,
}

impl RequestQueue for FcfsQueue {
    fn push(&mut self, entry: QueueEntry) {
        self.deque.push_back(entry.handle);
    }
    fn prepend(&mut self, entry: QueueEntry) {
        self.deque.push_front(entry.handle);
    }
    fn prepend_all(&mut self, entries: Vec<QueueEntry>) {
        for e in entries.into_iter().rev() {
            self.deque.push_front(e.handle);
        }
    }
    fn peek(&self) -> Option<Handle> {
        self.deque.front().copied()
    }
    fn pop(&mut self) -> Option<Handle> {
        self.deque.pop_front()
    }
    fn remove(&mut self, handle: Handle) -> bool {
        match self.deque.iter().position(|&h| h == handle) {
            Some(i) => {
                self.deque.remove(i);
                true
            }
            None => false,
        }
    }
    fn len(&self) -> usize {
        self.deque.len()
    }
    fn ordered(&self) -> Vec<Handle> {
        self.deque.iter().copied().collect()
    }
}

/// Heap order `(priority, arrival_time, request_id)`: the request id breaks
/// ties so a trace schedules the same whatever the insertion order.
#[derive(Debug, Clone)]
struct PriorityKey(QueueEntry);

impl Ord for PriorityKey {
    fn cmp(&self, other: &Self) -> Ordering {
        let (a, b) = (&self.0, &other.0);
        a.priority
            .cmp(&b.priority)
            .then(a.arrival_time.total_cmp(&b.arrival_time))
            .then_with(|| a.request_id.cmp(&b.request_id))
            .then(a.handle.cmp(&b.handle))
    }
}
impl PartialOrd for PriorityKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for PriorityKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for PriorityKey {}

#[derive(Debug, Default)]
pub struct PriorityQueue {
    set: BTreeSet<PriorityKey>,
    /// handle -> key, so removal by handle needs no scan.
    keys: std::collections::HashMap<Handle, QueueEntry>,
}

impl RequestQueue for PriorityQueue {
    fn push(&mut self, entry: QueueEntry) {
        self.keys.insert(entry.handle, entry.clone());
        self.set.insert(PriorityKey(entry));
    }
    fn prepend(&mut self, entry: QueueEntry) {
        self.push(entry);
    }
    fn prepend_all(&mut self, entries: Vec<QueueEntry>) {
        for e in entries {
            self.push(e);
        }
    }
    fn peek(&self) -> Option<Handle> {
        self.set.first().map(|k| k.0.handle)
    }
    fn pop(&mut self) -> Option<Handle> {
        let k = self.set.pop_first()?;
        self.keys.remove(&k.0.handle);
        Some(k.0.handle)
    }
    fn remove(&mut self, handle: Handle) -> bool {
        match self.keys.remove(&handle) {
            Some(e) => self.set.remove(&PriorityKey(e)),
            None => false,
        }
    }
    fn len(&self) -> usize {
        self.set.len()
    }
    fn ordered(&self) -> Vec<Handle> {
        self.set.iter().map(|k| k.0.handle).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(handle: Handle, priority: i64, arrival: f64, id: &str) -> QueueEntry {
        QueueEntry {
            handle,
            priority,
            arrival_time: arrival,
            request_id: id.into(),
        }
    }

    #[test]
    fn s14_fcfs_prepend_puts_at_front_and_prepend_all_keeps_order() {
        let mut q = FcfsQueue::default();
        q.push(e(1, 0, 1.0, "a"));
        q.push(e(2, 0, 2.0, "b"));
        q.prepend(e(3, 0, 3.0, "c"));
        assert_eq!(q.ordered(), vec![3, 1, 2]);
        q.prepend_all(vec![e(4, 0, 0.0, "d"), e(5, 0, 0.0, "e")]);
        assert_eq!(q.ordered(), vec![4, 5, 3, 1, 2]);
        assert!(q.remove(3));
        assert!(!q.remove(3));
        assert_eq!(q.pop(), Some(4));
    }

    #[test]
    fn s14_priority_orders_by_priority_then_arrival_then_request_id() {
        let mut q = PriorityQueue::default();
        q.push(e(1, 1, 1.0, "a"));
        q.push(e(2, 0, 5.0, "b"));
        q.push(e(3, 0, 5.0, "a"));
        q.push(e(4, 0, 2.0, "z"));
        assert_eq!(q.ordered(), vec![4, 3, 2, 1]);
        // "prepend" is a plain insert: a late, low-priority request stays behind.
        q.prepend(e(5, 2, 0.0, "p"));
        assert_eq!(q.ordered(), vec![4, 3, 2, 1, 5]);
        assert!(q.remove(3));
        assert_eq!(q.pop(), Some(4));
        assert_eq!(q.pop(), Some(2));
    }

    #[test]
    fn s14_priority_order_is_independent_of_insertion_order() {
        let entries = vec![e(1, 0, 1.0, "b"), e(2, 0, 1.0, "a"), e(3, -1, 9.0, "c")];
        let mut fwd = PriorityQueue::default();
        let mut rev = PriorityQueue::default();
        for x in entries.iter().cloned() {
            fwd.push(x);
        }
        for x in entries.into_iter().rev() {
            rev.push(x);
        }
        assert_eq!(fwd.ordered(), rev.ordered());
        assert_eq!(fwd.ordered(), vec![3, 2, 1]);
    }
}
