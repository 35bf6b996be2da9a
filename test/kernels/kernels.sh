#!/usr/bin/env bash
# Boots Debian's distribution kernels under qemu (TCG) with this machine's own
# userspace shared read-only over 9p, and runs a command inside each: the same
# test binaries that run here, on the kernels Kubernetes nodes run.
#
#   kernels.sh fetch SUITE         download and unpack SUITE's linux-image-amd64
#   kernels.sh run SUITE CMD...    boot SUITE's kernel, run CMD (as root, in the
#                                  host's file system), exit with CMD's status
#
# SUITE is bullseye (5.10), bookworm (6.1) or trixie (6.12). The packages come
# from Debian's archive through an apt configuration of our own under
# $KERNELS_DIR (never the machine's sources). KVM guests hang on this machine,
# so qemu runs with -accel tcg: slow (a node-shape row ~10x here), but real.
set -euo pipefail

KERNELS_DIR=${KERNELS_DIR:-/var/tmp/stunnerd-xdp-kernels}
GUEST_MEM=${GUEST_MEM:-3G}
GUEST_CPUS=${GUEST_CPUS:-2}
# A guest that runs longer than this is stopped (qemu killed, status 124).
GUEST_TIMEOUT=${GUEST_TIMEOUT:-1800}
here=$(cd "$(dirname "$0")" && pwd)

die() { echo "kernels.sh: $*" >&2; exit 2; }

apt_opts() {
	local d=$KERNELS_DIR/$1/apt
	echo "-o Dir::Etc::sourcelist=$d/sources.list -o Dir::Etc::sourceparts=- -o Dir::State::Lists=$d/lists -o Dir::Cache=$d/cache -o Dir::State::status=/dev/null -o Debug::NoLocking=1"
}

# fetch SUITE: the newest linux-image-<abi>-amd64 the suite's metapackage names,
# unpacked into $KERNELS_DIR/SUITE/root with modules.dep made by depmod.
fetch() {
	local suite=$1 d=$KERNELS_DIR/$1
	case $suite in bullseye|bookworm|trixie) ;; *) die "unknown suite $suite (bullseye, bookworm, trixie)";; esac
	if [ -f "$d/root/.done" ]; then return 0; fi
	rm -rf "$d"; mkdir -p "$d/apt/lists/partial" "$d/apt/cache/archives/partial" "$d/root"
	cat > "$d/apt/sources.list" <<SRC
deb http://deb.debian.org/debian $suite main
deb http://deb.debian.org/debian-security $suite-security main
SRC
	# shellcheck disable=SC2046
	apt-get $(apt_opts "$suite") update -qq
	local pkg
	# shellcheck disable=SC2046
	pkg=$(apt-cache $(apt_opts "$suite") depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
	[ -n "$pkg" ] || die "$suite: linux-image-amd64 names no kernel package"
	# shellcheck disable=SC2046
	(cd "$d" && apt-get $(apt_opts "$suite") download "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
	dpkg-deb -x "$d"/linux-image-*.deb "$d/root"
	rm -f "$d"/linux-image-*.deb
	# trixie ships its modules under usr/lib only.
	[ -e "$d/root/lib" ] || ln -s usr/lib "$d/root/lib"
	local ver
	ver=$(ls "$d/root/lib/modules")
	depmod -b "$d/root" "$ver"
	echo "$pkg" > "$d/package"
	touch "$d/root/.done"
	echo "kernels.sh: $suite: $pkg ($ver)"
}

# initramfs SUITE: busybox, the modules that reach the 9p root, and init.
initramfs() {
	local suite=$1 d=$KERNELS_DIR/$1 ver img
	ver=$(ls "$d/root/lib/modules")
	# Named by what goes in: checkouts that share $KERNELS_DIR may differ in init.
	img=$d/initramfs-$(cat "$here/init" /bin/busybox | sha256sum | cut -c1-12).cpio.gz
	if [ -f "$img" ]; then echo "$img"; return 0; fi
	local t; t=$(mktemp -d)
	mkdir -p "$t"/{bin,proc,sys,dev,newroot,mods}
	cp /bin/busybox "$t/bin/busybox"
	cp "$here/init" "$t/init"; chmod +x "$t/init"
	local m n=0
	for m in $( { modprobe -d "$d/root" -S "$ver" --show-depends 9p; modprobe -d "$d/root" -S "$ver" --show-depends 9pnet_virtio; modprobe -d "$d/root" -S "$ver" --show-depends virtio_pci; } | awk '$1=="insmod"{print $2}'); do
		local base; base=$(basename "$m"); base=${base%.xz}
		grep -qx "$base" "$t/mods/order" 2>/dev/null && continue
		case $m in *.xz) xz -dc "$m" > "$t/mods/$base";; *) cp "$m" "$t/mods/$base";; esac
		echo "$base" >> "$t/mods/order"; n=$((n+1))
	done
	(cd "$t" && find . | cpio -o -H newc --quiet | gzip -1) > "$img.tmp"
	mv "$img.tmp" "$img"
	rm -rf "$t"
	echo "$img"
}

# run SUITE CMD...: boot and run CMD in the host's file system (read-only)
# with tmpfs on /tmp, /run and /root (the working directory, which may lie
# under them, laid back over them), the guest kernel's modules on
# /lib/modules, and $KERNELS_OUT (read-write) shared at the same path.
run() {
	local suite=$1; shift
	[ $# -gt 0 ] || die "run: no command"
	fetch "$suite"
	local d=$KERNELS_DIR/$suite ver out img
	img=$(initramfs "$suite")
	ver=$(ls "$d/root/lib/modules")
	out=${KERNELS_OUT:-$(mktemp -d)}
	mkdir -p "$out"
	# The guest binds its modules over /lib/modules, which must exist here.
	mkdir -p /usr/lib/modules
	{
		echo "cd $(printf %q "$PWD")"
		# The environment the command sees, less what belongs to this machine's session.
		env | grep -E '^(CI|PATH|GO[A-Z]*|HOME|STUNNERD_XDP|TURNCAT|STUNNERD|STUNNERD_121|UDPECHO|ETCD|KUBE_APISERVER|KERNELS_[A-Z_]*|TEST[A-Z_]*|UPDATE_VERIFIER|VERIFIER_OUT)=' | sed 's/^/export /; s/=\(.*\)$/=\x27\1\x27/'
		printf '%q ' "$@"; echo
	} > "$out/cmd.sh"
	rm -f "$out/rc"
	echo "kernels.sh: booting $suite ($ver) with qemu TCG, ${GUEST_CPUS} CPUs, ${GUEST_MEM}: $*"
	local status=0
	timeout --foreground -k 10 "$GUEST_TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp "$GUEST_CPUS" -m "$GUEST_MEM" \
		-nographic -no-reboot -monitor none -serial stdio \
		-kernel "$d/root/boot/vmlinuz-$ver" -initrd "$img" \
		-append "console=ttyS0 panic=-1 quiet loglevel=3 kmods=$d/root/lib/modules out=$out wd=$PWD" \
		-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
		-virtfs "local,path=$out,mount_tag=out,security_model=none" </dev/null || status=$?
	if [ "$status" = 124 ]; then echo "kernels.sh: $suite: stopped after ${GUEST_TIMEOUT}s"; return 124; fi
	[ -f "$out/rc" ] || { echo "kernels.sh: $suite: the guest ended without a status (qemu $status)"; return 3; }
	return "$(cat "$out/rc")"
}

cmd=${1:-}; shift || true
case $cmd in
	fetch) [ $# -ge 1 ] || die "fetch SUITE..."; for s in "$@"; do fetch "$s"; done ;;
	run) [ $# -ge 2 ] || die "run SUITE CMD..."; run "$@" ;;
	*) die "usage: kernels.sh fetch SUITE... | run SUITE CMD..." ;;
esac
