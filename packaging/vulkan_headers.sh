#!/bin/bash
# Vulkan headers new enough for the llama.cpp that llama-cpp-python 0.3.36 vendors.
#
# Its Vulkan backend uses VK_EXT_layer_settings (vk::LayerSettingEXT) unguarded,
# which Vulkan-Headers 1.3.239 (Debian 12's libvulkan-dev) does not declare. Where
# the system's headers lack it, Debian 13's libvulkan-dev is downloaded (apt, with
# a package list of its own: the system's sources are not touched) and unpacked
# under DIR; headers only, the system's loader stays. Prints the CMake option that
# points the build at them, or nothing when the system's headers do.
set -euo pipefail
dir=${1:?usage: vulkan_headers.sh DIR}
if grep -qs "LayerSettingEXT" /usr/include/vulkan/vulkan_structs.hpp; then
  exit 0
fi
if [ ! -e "$dir/usr/include/vulkan/vulkan_structs.hpp" ]; then
  echo ">> The system's Vulkan headers are older than llama.cpp's Vulkan backend needs:" >&2
  echo ">> unpacking Debian 13's libvulkan-dev headers into $dir." >&2
  bash "$(dirname "$0")/debian_unpack.sh" trixie "$dir" libvulkan-dev
fi
echo "-DVulkan_INCLUDE_DIR=$(cd "$dir" && pwd)/usr/include"
