//! Image resolution: image references to unpacked rootfs directories in a shared cache.
