# Sourced by the GPU scripts and probes (from the repository root): mount_huge DIR SIZE makes DIR
# and mounts on it a tmpfs of SIZE whose pages are always huge (huge=always: 2 MiB pages), unless
# one is mounted there already; fails if it cannot be mounted.
mount_huge() { mkdir -p "$1"; mountpoint -q "$1" || mount -t tmpfs -o "size=$2,huge=always" possum-huge "$1"; }
