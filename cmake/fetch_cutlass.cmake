# The one fetch of CUTLASS's C++ headers: the pinned PyPI wheel nvidia-cutlass (py3-none-any), its
# cutlass_library/source/include folder, put at DEST/include. PyPI's wheel rather than a git clone because pip
# already knows the user's index, proxy and certificates, and the wheel is 6 MB against CUTLASS's 200 MB history.
#
# Used two ways:
#   include(fetch_cutlass) then simpo_fetch_cutlass(DEST RESULT_VAR [PYTHON ...]): fused/cuda/CMakeLists.txt, at
#     configure time, when the CUDA backend is built and SIMPO_CUTLASS_DIR is left at its default;
#   cmake -DDEST=<folder> [-DPYTHON=<python>] -P cmake/fetch_cutlass.cmake: fused/cuda/fetch_cutlass.sh.
# Never fails the build: without PyPI (or pip) RESULT_VAR is FALSE and a warning says why.
set(SIMPO_CUTLASS_VERSION 4.2.0.0)

function(simpo_fetch_cutlass dest result_var)
  cmake_parse_arguments(arg "" "" "PYTHON" ${ARGN})
  set(${result_var} FALSE PARENT_SCOPE)
  # A Python with pip: the one the build uses first (setup.sh's venv, scikit-build-core's), then any python3.
  # Any will do: the wheel is pure.
  find_program(simpo_python3 NAMES python3 python)
  set(pip "")
  foreach(python IN LISTS arg_PYTHON simpo_python3)
    if(python)
      execute_process(COMMAND "${python}" -m pip --version RESULT_VARIABLE no_pip OUTPUT_QUIET ERROR_QUIET)
      if(NOT no_pip)
        set(pip "${python}" -m pip)
        break()
      endif()
    endif()
  endforeach()
  if(NOT pip)
    find_program(simpo_pip NAMES pip3 pip)
    if(simpo_pip)
      set(pip "${simpo_pip}")
    else()
      message(WARNING "simpo-verify: cannot fetch CUTLASS: no pip (tried ${arg_PYTHON} ${simpo_python3}, pip3, pip)")
      return()
    endif()
  endif()

  set(tmp "${dest}/.fetch")
  file(REMOVE_RECURSE "${tmp}")
  # Short timeouts: an unreachable index should cost seconds, not pip's default retries.
  execute_process(COMMAND ${pip} download --no-deps --only-binary=:all: --disable-pip-version-check
                          --timeout 20 --retries 1 "nvidia-cutlass==${SIMPO_CUTLASS_VERSION}" -d "${tmp}"
                  RESULT_VARIABLE failed OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  file(GLOB wheel "${tmp}/nvidia_cutlass-${SIMPO_CUTLASS_VERSION}-*.whl")
  if(failed OR NOT wheel)
    string(STRIP "${err}" err)
    string(REGEX REPLACE ".*\n" "" last_line "${err}")
    string(JOIN " " pip_command ${pip})
    message(WARNING "simpo-verify: could not download nvidia-cutlass==${SIMPO_CUTLASS_VERSION} with ${pip_command} "
                    "(PyPI unreachable?): ${last_line}")
    file(REMOVE_RECURSE "${tmp}")
    return()
  endif()
  file(ARCHIVE_EXTRACT INPUT "${wheel}" DESTINATION "${tmp}" PATTERNS "cutlass_library/source/include/*")
  if(NOT EXISTS "${tmp}/cutlass_library/source/include/cutlass/cutlass.h")
    message(WARNING "simpo-verify: ${wheel} has no cutlass_library/source/include/cutlass/cutlass.h")
    file(REMOVE_RECURSE "${tmp}")
    return()
  endif()
  file(REMOVE_RECURSE "${dest}/include")
  file(RENAME "${tmp}/cutlass_library/source/include" "${dest}/include")
  file(REMOVE_RECURSE "${tmp}")
  message(NOTICE "simpo-verify: CUTLASS ${SIMPO_CUTLASS_VERSION} headers (PyPI nvidia-cutlass) in ${dest}/include")
  set(${result_var} TRUE PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(NOT DEST)
    message(FATAL_ERROR "usage: cmake -DDEST=<folder> [-DPYTHON=<python>] -P ${CMAKE_CURRENT_LIST_FILE}")
  endif()
  simpo_fetch_cutlass("${DEST}" fetched PYTHON ${PYTHON})
  if(NOT fetched)
    message(FATAL_ERROR "simpo-verify: no CUTLASS headers fetched (above: why)")
  endif()
endif()
