//! s3s-fs keeps its objects on disk: a restarted server still serves a published artifact.

mod common;

use fastbox_artifact::{ArtifactStore, IndexKey, NoProgress, materialize, publish_index};
use fastbox_testkit::s3::S3ServerKind;

#[test]
fn an_s3s_fs_restart_keeps_the_data() {
    let Some(mut env) = common::env(S3ServerKind::S3sFs) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    common::tree(&src, "persisted");
    let key = IndexKey::try_new("persisted:1").unwrap();
    let published = {
        let store = env.store();
        publish_index(&store, &key, &src, common::meta(), &NoProgress).unwrap()
    };

    env.server.restart().expect("restart s3s-fs");

    let store = env.store();
    assert_eq!(store.index_get(&key).unwrap(), Some(published.manifest));
    assert_eq!(store.list_blocks().unwrap().len(), 4);
    let dest = dir.path().join("dest");
    materialize(&store, &published.manifest, &dest).unwrap();
    assert_eq!(common::contents(&dest), common::contents(&src));
}
