//! [`forward_store!`](crate::forward_store): the methods of [`ArtifactStore`] a wrapping
//! store passes straight to the store it wraps, so a wrapper writes only what it changes.
//!
//! [`ArtifactStore`]: crate::ArtifactStore

/// Inside `impl ArtifactStore for W`, writes each named method as a call of the same method
/// of field `inner`: `forward_store!(inner; has_block, list_blocks, ...)`. Two names stand
/// for groups: `manifests` (the five manifest methods) and `index` (the four index ones).
#[macro_export]
macro_rules! forward_store {
    ($inner:ident; $($method:ident),+ $(,)?) => {
        $( $crate::forward_store!(@one $inner $method); )+
    };
    (@one $inner:ident manifests) => {
        $crate::forward_store!(
            $inner;
            put_manifest,
            get_manifest,
            has_manifest,
            delete_manifest,
            list_manifests
        );
    };
    (@one $inner:ident index) => {
        $crate::forward_store!($inner; index_create_if_absent, index_get, index_delete, list_index);
    };
    (@one $inner:ident put_block) => {
        fn put_block(
            &self,
            digest: &$crate::Digest,
            bytes: &[u8],
        ) -> Result<$crate::Stored, $crate::StoreError> {
            self.$inner.put_block(digest, bytes)
        }
    };
    (@one $inner:ident get_block) => {
        fn get_block(&self, digest: &$crate::Digest) -> Result<Vec<u8>, $crate::StoreError> {
            self.$inner.get_block(digest)
        }
    };
    (@one $inner:ident stream_block) => {
        fn stream_block(
            &self,
            digest: &$crate::Digest,
            sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
        ) -> Result<u64, $crate::StoreError> {
            self.$inner.stream_block(digest, sink)
        }
    };
    (@one $inner:ident has_block) => {
        fn has_block(&self, digest: &$crate::Digest) -> Result<bool, $crate::StoreError> {
            self.$inner.has_block(digest)
        }
    };
    (@one $inner:ident delete_block) => {
        fn delete_block(&self, digest: &$crate::Digest) -> Result<(), $crate::StoreError> {
            self.$inner.delete_block(digest)
        }
    };
    (@one $inner:ident list_blocks) => {
        fn list_blocks(&self) -> Result<Vec<$crate::StoredObject>, $crate::StoreError> {
            self.$inner.list_blocks()
        }
    };
    (@one $inner:ident put_manifest) => {
        fn put_manifest(
            &self,
            bytes: &[u8],
        ) -> Result<($crate::Digest, $crate::Stored), $crate::StoreError> {
            self.$inner.put_manifest(bytes)
        }
    };
    (@one $inner:ident get_manifest) => {
        fn get_manifest(&self, digest: &$crate::Digest) -> Result<Vec<u8>, $crate::StoreError> {
            self.$inner.get_manifest(digest)
        }
    };
    (@one $inner:ident has_manifest) => {
        fn has_manifest(&self, digest: &$crate::Digest) -> Result<bool, $crate::StoreError> {
            self.$inner.has_manifest(digest)
        }
    };
    (@one $inner:ident delete_manifest) => {
        fn delete_manifest(&self, digest: &$crate::Digest) -> Result<(), $crate::StoreError> {
            self.$inner.delete_manifest(digest)
        }
    };
    (@one $inner:ident list_manifests) => {
        fn list_manifests(&self) -> Result<Vec<$crate::StoredObject>, $crate::StoreError> {
            self.$inner.list_manifests()
        }
    };
    (@one $inner:ident index_create_if_absent) => {
        fn index_create_if_absent(
            &self,
            key: &$crate::IndexKey,
            digest: &$crate::Digest,
        ) -> Result<$crate::IndexCreate, $crate::StoreError> {
            self.$inner.index_create_if_absent(key, digest)
        }
    };
    (@one $inner:ident index_get) => {
        fn index_get(
            &self,
            key: &$crate::IndexKey,
        ) -> Result<Option<$crate::Digest>, $crate::StoreError> {
            self.$inner.index_get(key)
        }
    };
    (@one $inner:ident index_delete) => {
        fn index_delete(&self, key: &$crate::IndexKey) -> Result<(), $crate::StoreError> {
            self.$inner.index_delete(key)
        }
    };
    (@one $inner:ident list_index) => {
        fn list_index(
            &self,
        ) -> Result<Vec<($crate::IndexKey, $crate::Digest)>, $crate::StoreError> {
            self.$inner.list_index()
        }
    };
}
