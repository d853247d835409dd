# SPDX-License-Identifier: BSD-3-Clause
# amp_require_torch_version(SUPPORTED ALLOW): stops the configure when the
# LibTorch found (Torch_VERSION, after find_package(Torch)) is not of the
# SUPPORTED major.minor version, unless ALLOW is true, where it warns.
# Used by amp's own build and by the installed find_package(amp) config.
#
# Why: amp mirrors one LibTorch's autocast op lists and calls its private ops
# (_amp_*, _fused_adam_, _scaled_mm), and LibTorch keeps no ABI from one minor
# version to the next, so an amp built for another one miscasts or fails to
# link or load - or links and crashes.
function(amp_require_torch_version supported allow)
  if(NOT Torch_VERSION)
    message(FATAL_ERROR "amp: find_package(Torch) set no Torch_VERSION; amp needs LibTorch ${supported}.x.")
  endif()
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" found "${Torch_VERSION}")
  if(found VERSION_EQUAL supported)
    return()
  endif()
  set(what "amp ${amp_VERSION} supports LibTorch ${supported}.x only; found LibTorch ${Torch_VERSION} at \
'${Torch_DIR}'. amp mirrors LibTorch ${supported}'s autocast lists and calls its private ops, and \
LibTorch keeps no ABI across minor versions.")
  if(allow)
    message(WARNING "${what} Continuing, as AMP_ALLOW_UNSUPPORTED_TORCH is ON: untested, at your own risk.")
  else()
    message(FATAL_ERROR "${what} Point CMAKE_PREFIX_PATH at LibTorch ${supported} (pip install "
                        "'torch==${supported}.*', then python -c 'import torch; print(torch.utils.cmake_prefix_path)'), "
                        "or configure with -DAMP_ALLOW_UNSUPPORTED_TORCH=ON to try this one at your own risk.")
  endif()
endfunction()
