#!/bin/sh
# A small Linux for tests/emulated/bochs.py, from Debian's linux-source-6.1 package: tinyconfig
# plus what the runner needs (64-bit, serial console, initramfs, ELF, futex for OpenMP). It
# reaches init in Bochs in under a minute, where Debian's own kernel had not in 8. AMX needs nothing more:
# its state and arch_prctl(ARCH_REQ_XCOMP_PERM) are core x86 code since 5.16.
#   tests/emulated/build_kernel.sh OUT_DIR   -> OUT_DIR/bzImage
# Needs gcc, make, flex, bison, bc and libelf-dev (Debian packages).
set -eu
out=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download linux-source-6.1 >/dev/null
dpkg-deb -x linux-source-6.1_*.deb pkg
tar -xf pkg/usr/src/linux-source-6.1.tar.xz
cd linux-source-6.1
make tinyconfig >/dev/null
./scripts/config --enable 64BIT --enable PRINTK --enable TTY --enable SERIAL_8250 \
    --enable SERIAL_8250_CONSOLE --enable BLK_DEV_INITRD --enable RD_GZIP --enable BINFMT_ELF \
    --enable FUTEX --enable POSIX_TIMERS --enable X86_UP_APIC --disable X86_5LEVEL \
    --enable PROC_FS --enable MULTIUSER --enable SHMEM --enable FILE_LOCKING
make olddefconfig >/dev/null
make -j"$(nproc)" bzImage >/dev/null
mkdir -p "$out"
cp arch/x86/boot/bzImage "$out/bzImage"
echo "$out/bzImage"
