//! Mounting a filesystem image through a loop device, in process: what `mount -o loop` does
//! (a free device from `/dev/loop-control`, `LOOP_CONFIGURE` with auto-clear, then
//! mount(2)), without a `mount` process (about 9 ms a writable layer here). The device goes
//! away by itself when the filesystem is unmounted.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use nix::mount::{MsFlags, mount};

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
/// Detach the device when its last user (the mount) is gone.
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// A device another process took between `LOOP_CTL_GET_FREE` and `LOOP_CONFIGURE` is
/// answered `EBUSY`: ask for another this many times.
const ATTEMPTS: usize = 16;

/// `struct loop_info64` of `<linux/loop.h>`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` of `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Mounts the filesystem image `image` (of type `fstype`) at `target` through a new loop
/// device, with `flags`.
pub fn mount_image(image: &Path, target: &Path, fstype: &str, flags: MsFlags) -> io::Result<()> {
    let backing = OpenOptions::new().read(true).write(true).open(image)?;
    let device = attach(&backing)?;
    drop(backing);
    let path = format!("/dev/loop{}", device.number);
    mount(
        Some(path.as_str()),
        target,
        Some(fstype),
        flags,
        None::<&str>,
    )
    .map_err(|e| {
        io::Error::other(format!(
            "mount {path} ({}) at {}: {e}",
            image.display(),
            target.display()
        ))
    })
    // `device` closes here: with auto-clear, the mount now holds the device alone.
}

/// An attached loop device (auto-clear), open.
struct LoopDevice {
    number: i32,
    _file: File,
}

/// Attaches `backing` to a free loop device.
fn attach(backing: &File) -> io::Result<LoopDevice> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")?;
    let mut last = io::Error::other("no loop device");
    for _ in 0..ATTEMPTS {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if number < 0 {
            return Err(io::Error::last_os_error());
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/dev/loop{number}"))?;
        let config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: LO_FLAGS_AUTOCLEAR,
                lo_file_name: [0; 64],
                lo_crypt_name: [0; 64],
                lo_encrypt_key: [0; 32],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which `config` is, for the
        // duration of the call.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), LOOP_CONFIGURE, &config) };
        if r == 0 {
            return Ok(LoopDevice {
                number,
                _file: file,
            });
        }
        last = io::Error::last_os_error();
        if last.raw_os_error() != Some(libc::EBUSY) {
            return Err(last);
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_mounts_and_its_device_goes_with_the_unmount() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root (loop devices, mounts)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("fs.img");
        File::create(&image).unwrap().set_len(64 << 20).unwrap();
        let made = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&image)
            .status()
            .unwrap();
        assert!(made.success());
        let target = dir.path().join("mnt");
        std::fs::create_dir(&target).unwrap();
        mount_image(&image, &target, "ext4", MsFlags::MS_NOATIME).unwrap();
        std::fs::write(target.join("x"), b"written").unwrap();
        let backing = |image: &Path| {
            std::fs::read_dir("/sys/block")
                .unwrap()
                .flatten()
                .filter_map(|e| std::fs::read_to_string(e.path().join("loop/backing_file")).ok())
                .filter(|b| Path::new(b.trim()) == image)
                .count()
        };
        assert_eq!(backing(&image), 1, "one loop device backs the image");
        nix::mount::umount(&target).unwrap();
        // Auto-clear runs when the last reference goes; give the kernel a moment.
        for _ in 0..100 {
            if backing(&image) == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(
            backing(&image),
            0,
            "the device was released with the unmount"
        );
        mount_image(&image, &target, "ext4", MsFlags::empty()).unwrap();
        assert_eq!(std::fs::read(target.join("x")).unwrap(), b"written");
        nix::mount::umount(&target).unwrap();
        let missing = mount_image(
            &dir.path().join("none.img"),
            &target,
            "ext4",
            MsFlags::empty(),
        );
        assert!(missing.is_err());
    }

    #[test]
    fn the_structs_have_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
