//! [`Delegate`]: a backend that wraps another and hands it every call it does not take over
//! itself (tests inject faults this way: a cut link, a lost answer, a step before a write).

use crate::{Coordinator, Entry, Fence, Guard, Revision, StateBackend, StateError, Watch};

/// A wrapper of [`Delegate::inner`]: every [`StateBackend`] call goes to the inner backend
/// unless the wrapper overrides it here.
pub trait Delegate: Send + Sync {
    /// The wrapped backend.
    fn inner(&self) -> &dyn StateBackend;

    fn list(&self, table: &str) -> Result<Vec<Entry>, StateError> {
        self.inner().list(table)
    }

    fn get(&self, table: &str, key: &str) -> Result<Option<Entry>, StateError> {
        self.inner().get(table, key)
    }

    fn put(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<Revision, StateError> {
        self.inner().put(table, key, value, expected, fence)
    }

    fn create_under(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError> {
        self.inner().create_under(table, key, value, guard)
    }

    fn delete_under(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        guard: &Guard,
    ) -> Result<(), StateError> {
        self.inner().delete_under(table, key, expected, guard)
    }

    fn delete(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<(), StateError> {
        self.inner().delete(table, key, expected, fence)
    }

    fn describe(&self) -> String {
        self.inner().describe()
    }

    fn watch(&self, from: Revision) -> Result<Option<Watch>, StateError> {
        self.inner().watch(from)
    }

    fn coordinator(&self) -> Option<&dyn Coordinator> {
        self.inner().coordinator()
    }
}

impl<D: Delegate> StateBackend for D {
    fn list(&self, table: &str) -> Result<Vec<Entry>, StateError> {
        Delegate::list(self, table)
    }

    fn get(&self, table: &str, key: &str) -> Result<Option<Entry>, StateError> {
        Delegate::get(self, table, key)
    }

    fn put(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<Revision, StateError> {
        Delegate::put(self, table, key, value, expected, fence)
    }

    fn create_under(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError> {
        Delegate::create_under(self, table, key, value, guard)
    }

    fn delete_under(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        guard: &Guard,
    ) -> Result<(), StateError> {
        Delegate::delete_under(self, table, key, expected, guard)
    }

    fn delete(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<(), StateError> {
        Delegate::delete(self, table, key, expected, fence)
    }

    fn describe(&self) -> String {
        Delegate::describe(self)
    }

    fn watch(&self, from: Revision) -> Result<Option<Watch>, StateError> {
        Delegate::watch(self, from)
    }

    fn coordinator(&self) -> Option<&dyn Coordinator> {
        Delegate::coordinator(self)
    }
}
