//! Which sandboxes' ports need a credential: the node proxy asks the records
//! ([`AccessApi`]). A `secureAccess` sandbox's record holds its token; every other sandbox is
//! open by URL.

use async_trait::async_trait;
use fastbox_node_api::control::{AccessApi, SandboxAccess};

use super::lifecycle::Lifecycle;

#[async_trait]
impl AccessApi for Lifecycle {
    async fn access(&self, id: &str) -> Option<SandboxAccess> {
        let records = self.records.lock().expect("records lock");
        let record = records.get(id)?;
        Some(match &record.secure_access {
            Some(secure) => SandboxAccess::Secure(secure.token()),
            None => SandboxAccess::Open,
        })
    }
}
