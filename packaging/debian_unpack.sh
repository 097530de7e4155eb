#!/bin/bash
# Download Debian packages of another suite with apt (a package list of its own: the
# system's sources are not touched) and unpack them under DIR; nothing is installed.
#   debian_unpack.sh SUITE DIR PACKAGE...
set -euo pipefail
suite=${1:?usage: debian_unpack.sh SUITE DIR PACKAGE...}
dir=${2:?usage: debian_unpack.sh SUITE DIR PACKAGE...}
shift 2
apt_dir=$(mktemp -d)
trap 'rm -rf "$apt_dir"' EXIT
mkdir -p "$apt_dir/lists/partial"
echo "deb http://deb.debian.org/debian $suite main" > "$apt_dir/sources.list"
opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
      -o "Dir::State::Lists=$apt_dir/lists" -o "APT::Get::List-Cleanup=0"
      -o "APT::Sandbox::User=root")
apt-get -qq "${opts[@]}" update >&2
(cd "$apt_dir" && apt-get -qq "${opts[@]}" download "$@" >&2)
rm -rf "$dir" && mkdir -p "$dir"
for deb in "$apt_dir"/*.deb; do dpkg -x "$deb" "$dir"; done
