#!/bin/bash
# A software Vulkan device (Mesa's lavapipe) that runs the gpu set: Mesa 24 or newer.
#
# Debian 12's Mesa 22.3 lavapipe crashes in its own worker thread while llama.cpp's
# Vulkan backend decodes Gemma 3 270M (one token, layers split with the CPU); the
# Mesa of bookworm-backports (25.0) does not. On Debian 12 with an older Mesa this
# adds bookworm-backports to apt's sources and installs its mesa-vulkan-drivers
# (as root, or through sudo); elsewhere it only says what it found.
set -euo pipefail
sudo=$([ "$(id -u)" = 0 ] || echo sudo)
version=$(dpkg-query -W -f '${Version}' mesa-vulkan-drivers 2>/dev/null || echo none)
major=${version%%.*}
if [ "$version" != none ] && [ "$major" -ge 24 ] 2>/dev/null; then
  exit 0
fi
if ! grep -qs 'VERSION_CODENAME=bookworm' /etc/os-release; then
  echo ">> mesa-vulkan-drivers is $version; the gpu set on lavapipe wants Mesa 24 or newer." >&2
  exit 0
fi
echo ">> Installing Mesa from bookworm-backports for lavapipe (the system's is $version)." >&2
echo "deb http://deb.debian.org/debian bookworm-backports main" |
  $sudo tee /etc/apt/sources.list.d/localkv-bookworm-backports.list >/dev/null
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq -t bookworm-backports \
  mesa-vulkan-drivers >/dev/null
