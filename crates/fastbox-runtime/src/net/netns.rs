//! Named network namespaces, the way `ip netns` keeps them, without `ip netns exec`.
//!
//! A namespace is created by a dedicated thread that `unshare(CLONE_NEWNET)`s, switches
//! IPv6 off inside, and bind-mounts its `/proc/self/task/<tid>/ns/net` onto
//! `/run/netns/<name>`; the thread then exits and the mount keeps the namespace alive.
//! `/run/netns` is made a shared mount (as iproute2 does) so removing a namespace
//! propagates to mount namespaces that copied it. Nothing here creates a mount namespace:
//! CRIU refuses to dump the slave mounts `ip netns exec` leaves behind.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};

use super::NetError;

/// Where named network namespaces are bind-mounted (shared with iproute2).
pub const NETNS_DIR: &str = "/run/netns";

/// Inside a new namespace: IPv6 off for every interface that exists or will exist.
const IPV6_OFF: [&str; 2] = [
    "/proc/sys/net/ipv6/conf/all/disable_ipv6",
    "/proc/sys/net/ipv6/conf/default/disable_ipv6",
];

/// Inside a new namespace: unprivileged ICMP echo sockets for every group, so `ping` works
/// without CAP_NET_RAW (which sandboxes lack), as Docker configures its containers.
const PING_GROUP_RANGE: (&str, &str) = ("/proc/sys/net/ipv4/ping_group_range", "0 2147483647");

/// Path of the named namespace `name`.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

/// Whether process `pid` runs in the network namespace at `path` (same namespace inode).
/// False when either is gone.
pub fn process_is_in(pid: i32, path: &Path) -> bool {
    let ns_of = |p: &Path| fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    match (
        ns_of(Path::new(&format!("/proc/{pid}/ns/net"))),
        ns_of(path),
    ) {
        (Some(of_process), Some(at_path)) => of_process == at_path,
        _ => false,
    }
}

/// Opens a network namespace file (`slot.netns_path`) for `setns(fd, CLONE_NEWNET)`.
/// The descriptor is close-on-exec.
pub fn enter_netns(path: &Path) -> Result<OwnedFd, NetError> {
    let file = File::open(path).map_err(|source| NetError::Netns {
        name: path.display().to_string(),
        op: "open",
        source,
    })?;
    Ok(file.into())
}

/// The namespace inode of a netns file: what CRIU's `--external net[<inode>]:<key>` names.
pub fn netns_inode(path: &Path) -> Result<u64, NetError> {
    fs::metadata(path)
        .map(|m| m.ino())
        .map_err(|source| NetError::Netns {
            name: path.display().to_string(),
            op: "stat",
            source,
        })
}

/// Runs `f` on a fresh thread that first joins the network namespace at `path`; the
/// thread exits afterwards, so no pooled thread is left in the namespace. Sockets `f`
/// creates belong to that namespace, and so do processes it spawns.
pub fn in_netns<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> Result<T, NetError> {
    let fd = enter_netns(path)?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                setns(&fd, CloneFlags::CLONE_NEWNET).map_err(|e| NetError::Netns {
                    name: path.display().to_string(),
                    op: "setns",
                    source: e.into(),
                })?;
                Ok(f())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Creates the named namespace `name` with IPv6 disabled inside; returns its path.
/// Fails if the name is taken.
pub fn create(name: &str) -> Result<PathBuf, NetError> {
    ensure_netns_dir()?;
    let path = netns_path(name);
    let err = |op: &'static str| {
        let name = name.to_owned();
        move |source: io::Error| NetError::Netns { name, op, source }
    };
    let thread_path = path.clone();
    std::thread::scope(|scope| {
        scope
            .spawn(move || -> Result<(), NetError> {
                unshare(CloneFlags::CLONE_NEWNET).map_err(|e| err("unshare")(e.into()))?;
                disable_ipv6().map_err(err("disable ipv6"))?;
                write_sysctl(Path::new(PING_GROUP_RANGE.0), PING_GROUP_RANGE.1)
                    .map_err(err("set ping_group_range"))?;
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o444)
                    .open(&thread_path)
                    .map_err(err("create mount point"))?;
                let own = format!("/proc/self/task/{}/ns/net", nix::unistd::gettid());
                if let Err(e) = mount(
                    Some(own.as_str()),
                    &thread_path,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                ) {
                    let _ = fs::remove_file(&thread_path);
                    return Err(err("bind mount")(e.into()));
                }
                Ok(())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })?;
    Ok(path)
}

/// Switches IPv6 off in the calling thread's namespace and reads it back (proof the write
/// landed here). A kernel without IPv6 has nothing to switch off.
fn disable_ipv6() -> io::Result<()> {
    if !Path::new(IPV6_OFF[0]).exists() {
        return Ok(());
    }
    for knob in IPV6_OFF {
        write_sysctl(Path::new(knob), "1")?;
    }
    if read_sysctl(Path::new(IPV6_OFF[0]))? != "1" {
        return Err(io::Error::other("still enabled after writing 1"));
    }
    Ok(())
}

/// Removes the named namespace: detaches the bind mount and deletes the file. Missing
/// pieces are not errors, so this also cleans up half-created namespaces.
pub fn remove(name: &str) -> Result<(), NetError> {
    let path = netns_path(name);
    let err = |op: &'static str, source: io::Error| NetError::Netns {
        name: name.to_owned(),
        op,
        source,
    };
    match umount2(&path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(err("unmount", e.into())),
    }
    match fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err("remove", e)),
    }
}

/// Names of namespaces under `/run/netns`, files and mount points alike (a mount whose
/// file vanished still pins a namespace).
pub fn list() -> Result<Vec<String>, NetError> {
    let mut names = Vec::new();
    match fs::read_dir(NETNS_DIR) {
        Ok(dir) => {
            for entry in dir {
                let entry = entry.map_err(|e| io_err(NETNS_DIR, e))?;
                names.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(NETNS_DIR, e)),
    }
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| io_err("/proc/self/mountinfo", e))?;
    for line in mountinfo.lines() {
        // Field 5 is the mount point (octal escapes for spaces; our names have none).
        if let Some(point) = line.split(' ').nth(4)
            && let Some(name) = point.strip_prefix("/run/netns/")
            && !name.contains('/')
        {
            names.push(name.to_owned());
        }
    }
    names.sort();
    names.dedup();
    Ok(names)
}

/// Writes a `/proc/sys` knob in the calling thread's network namespace.
pub fn write_sysctl(path: &Path, value: &str) -> io::Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

/// Reads a `/proc/sys` knob in the calling thread's network namespace, trimmed.
pub fn read_sysctl(path: &Path) -> io::Result<String> {
    let mut s = String::new();
    File::open(path)?.read_to_string(&mut s)?;
    Ok(s.trim().to_owned())
}

fn io_err(path: &str, source: io::Error) -> NetError {
    NetError::Io {
        path: path.into(),
        source,
    }
}

/// Makes `/run/netns` exist and be a shared mount, once per process (iproute2's recipe:
/// make it shared; if it is not a mount point yet, bind-mount it onto itself first).
fn ensure_netns_dir() -> Result<(), NetError> {
    static DONE: Mutex<bool> = Mutex::new(false);
    let mut done = DONE.lock().unwrap_or_else(|p| p.into_inner());
    if *done {
        return Ok(());
    }
    fs::create_dir_all(NETNS_DIR).map_err(|e| io_err(NETNS_DIR, e))?;
    let make_shared = || {
        mount(
            Some("none"),
            NETNS_DIR,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    match make_shared() {
        Ok(()) => {}
        Err(Errno::EINVAL) => {
            mount(
                Some(NETNS_DIR),
                NETNS_DIR,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .and_then(|()| make_shared())
            .map_err(|e| io_err(NETNS_DIR, e.into()))?;
        }
        Err(e) => return Err(io_err(NETNS_DIR, e.into())),
    }
    *done = true;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_in_its_own_namespace_only() {
        let me = std::process::id() as i32;
        assert!(process_is_in(me, Path::new("/proc/self/ns/net")));
        // Another namespace file (a user namespace's inode is never a network one's).
        assert!(!process_is_in(me, Path::new("/proc/self/ns/user")));
        assert!(!process_is_in(
            me,
            Path::new("/run/netns/no-such-namespace")
        ));
        assert!(!process_is_in(i32::MAX, Path::new("/proc/self/ns/net")));
    }
}
