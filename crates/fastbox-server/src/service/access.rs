//! Which sandboxes' ports need a credential: the node proxy asks the records
//! ([`AccessApi`]). A `secureAccess` sandbox's record holds its token; every other sandbox is
//! open by URL.

use async_trait::async_trait;
use fastbox_node_api::control::{AccessApi, SandboxAccess};

use super::lifecycle::Lifecycle;

#[async_trait]
impl AccessApi for Lifecycle {
    /// From this server's records; a sandbox it has not heard of yet (made through another
    /// server a moment ago, its change not yet here through the store's watch) is read from
    /// the store. The node asks only for sandboxes it runs.
    async fn access(&self, id: &str) -> Option<SandboxAccess> {
        let cached = self.records.lock().expect("records lock").get(id).cloned();
        let record = match cached {
            Some(record) => record,
            None => self.refresh(id).ok()?,
        };
        Some(match &record.secure_access {
            Some(secure) => SandboxAccess::Secure(secure.token()),
            None => SandboxAccess::Open,
        })
    }
}
