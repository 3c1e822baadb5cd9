#!/bin/sh
# Copies a leasegate binary and the shared libraries it loads (as ldd lists them: glibc,
# libm, libgcc_s and the loader, nothing else) into a root file system tree:
#   deploy/rootfs.sh BINARY OUTDIR
# The image (deploy/Dockerfile) lays this tree over distroless/static, which has no glibc;
# tests/it/cli/deploy.rs runs the same tree under chroot.
set -eu
binary=$1
out=$2
install -D -m 0755 "$binary" "$out/usr/local/bin/leasegate"
libs=$(ldd "$binary" | grep -o '/[^ ]*' | sort -u)
[ -n "$libs" ] || { echo "rootfs.sh: ldd lists no library for $binary" >&2; exit 1; }
for lib in $libs; do
  # -L: the file itself, not the symlink; --parents: at the same path as on the builder.
  cp -L --parents "$lib" "$out/"
done
