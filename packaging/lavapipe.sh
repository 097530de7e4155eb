#!/bin/bash
# Mesa's software Vulkan device (lavapipe) from bookworm-backports, unpacked under DIR
# for the gpu set: nothing on the system changes.
#
# Debian 12's own lavapipe (Mesa 22.3) crashes in its worker thread now and then
# while llama.cpp's Vulkan backend decodes (SIGSEGV, not in llama.cpp or localkv);
# Mesa 25 from bookworm-backports runs the gpu set through. Its packages are
# downloaded with apt (a package list of its own) and unpacked here; the gpu set
# loads them through VK_ICD_FILENAMES and LD_LIBRARY_PATH (DIR/env names both; the
# Makefile adds them). Elsewhere than Debian 12 it does nothing: the
# system's Mesa is used.
set -euo pipefail
dir=${1:?usage: lavapipe.sh DIR}
[ -e "$dir/env" ] && exit 0
grep -qs 'VERSION_CODENAME=bookworm' /etc/os-release || exit 0
echo ">> Unpacking Mesa's lavapipe from bookworm-backports into $dir (Debian 12's crashes)." >&2
bash "$(dirname "$0")/debian_unpack.sh" bookworm-backports "$dir/root" \
  mesa-vulkan-drivers mesa-libgallium libdrm2 libdrm-amdgpu1
lib=$(cd "$(dirname "$(find "$dir/root/usr/lib" -name libvulkan_lvp.so | head -1)")" && pwd)
sed "s|\"library_path\": *\"[^\"]*\"|\"library_path\": \"$lib/libvulkan_lvp.so\"|" \
  "$dir/root/usr/share/vulkan/icd.d/lvp_icd.json" > "$dir/lvp_icd.json"
# what the gpu set's environment adds (the Makefile reads it)
echo "VK_ICD_FILENAMES=$(cd "$dir" && pwd)/lvp_icd.json LD_LIBRARY_PATH=$lib" > "$dir/env"
