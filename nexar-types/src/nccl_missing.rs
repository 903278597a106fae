//! What to tell a user whose libnccl did not load: where nexar looked, and, on a host with
//! only the NCCL runtime package, the link that makes it loadable. No library is opened here.

/// Where to look for a libnccl that cudarc did not load: `LD_LIBRARY_PATH`, then the usual
/// system and CUDA directories.
pub(crate) fn library_dirs(ld_library_path: Option<&std::ffi::OsStr>) -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> =
        ld_library_path.map(|p| std::env::split_paths(p).collect()).unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
    ] {
        dirs.push(d.into());
    }
    dirs
}

/// Why libnccl could not be loaded, as a user can act on it. The NCCL runtime package installs
/// only `libnccl.so.2`; cudarc opens `libnccl.so` (from the development package) and versioned
/// names that do not include `.so.2`, so a host with the runtime alone needs a link.
pub(crate) fn not_found_reason(dirs: &[std::path::PathBuf]) -> String {
    let only_runtime = dirs.iter().map(|d| d.join("libnccl.so.2")).find(|p| p.exists());
    match only_runtime {
        Some(found) => format!(
            "libnccl was not found under the names cudarc loads (libnccl.so and its versioned names), but {} \
             is there (the NCCL runtime package alone): install the development package (libnccl-dev), or link \
             it as libnccl.so in a directory on LD_LIBRARY_PATH: ln -s {} <dir>/libnccl.so",
            found.display(),
            found.display()
        ),
        None => "libnccl was not found (looked for libnccl.so and its versioned names on the library path; \
                 install NCCL, e.g. the libnccl2 and libnccl-dev packages)"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_with_only_the_runtime_library_is_told_how_to_link_it() {
        let dir = std::env::temp_dir().join(format!("nexar-nccl-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dirs = library_dirs(Some(std::ffi::OsStr::new(&format!("/nonexistent:{}", dir.display()))));
        assert_eq!(dirs[..2], [std::path::PathBuf::from("/nonexistent"), dir.clone()]);
        // Nothing there: install NCCL.
        let none = not_found_reason(&dirs[..2]);
        assert!(none.contains("not found") && none.contains("libnccl-dev"), "{none}");
        // The runtime package's file only: link it.
        let runtime = dir.join("libnccl.so.2");
        std::fs::write(&runtime, b"").unwrap();
        let link = not_found_reason(&dirs[..2]);
        assert!(link.contains(&runtime.display().to_string()) && link.contains("ln -s"), "{link}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
