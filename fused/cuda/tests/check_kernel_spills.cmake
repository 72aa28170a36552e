# cmake -DCOMPILER=nvcc -DSOURCE=file.cu -DINCLUDES="dir|dir|..." -DDEFINES="NAME=V|..." -DKERNELS=regex
#       -DOBJECT=out.o -P this
# ptxas -v over SOURCE for sm_90a, with the include folders and definitions of the library that builds it; fails if
# any kernel whose mangled name matches KERNELS spills registers to local memory, or if none matches (the pattern
# went stale).
string(REPLACE "|" ";" include_dirs "${INCLUDES}")
string(REPLACE "|" ";" definitions "${DEFINES}")
set(compile_flags)
foreach(dir IN LISTS include_dirs)
  list(APPEND compile_flags "-I${dir}")
endforeach()
foreach(definition IN LISTS definitions)
  list(APPEND compile_flags "-D${definition}")
endforeach()
execute_process(
  COMMAND "${COMPILER}" -O3 -DNDEBUG -std=c++20 --expt-relaxed-constexpr -diag-suppress=20012,2908
          --generate-code=arch=compute_90a,code=sm_90a ${compile_flags}
          -Xptxas=-v -c "${SOURCE}" -o "${OBJECT}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "compiling ${SOURCE} failed (${rc}):\n${out}${err}")
endif()
# ptxas -v prints, per kernel: "Compiling entry function 'NAME' for 'sm_90a'", "Function properties for NAME", then
# "N bytes stack frame, S bytes spill stores, L bytes spill loads".
string(REGEX MATCHALL "Compiling entry function '[^']+'[^\n]*\n[^\n]*\n[^\n]*spill stores" entries "${err}")
set(matched 0)
set(spilling)
foreach(entry IN LISTS entries)
  string(REGEX MATCH "'([^']+)'" name "${entry}")
  set(name "${CMAKE_MATCH_1}")
  if(NOT name MATCHES "${KERNELS}")
    continue()
  endif()
  math(EXPR matched "${matched} + 1")
  string(REGEX MATCH "([0-9]+) bytes spill stores" stores "${entry}")
  if(NOT CMAKE_MATCH_1 EQUAL 0)
    list(APPEND spilling "${CMAKE_MATCH_1} bytes of spill stores in ${name}")
  endif()
endforeach()
if(matched EQUAL 0)
  message(FATAL_ERROR "no kernel of ${SOURCE} matches '${KERNELS}' (ptxas said:):\n${err}")
endif()
if(spilling)
  string(REPLACE ";" "\n" spilling "${spilling}")
  message(FATAL_ERROR "kernels that must fit their registers spill:\n${spilling}")
endif()
message(STATUS "${matched} kernels matching '${KERNELS}' in ${SOURCE}: none spills")
