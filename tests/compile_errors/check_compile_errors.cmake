# SPDX-License-Identifier: BSD-3-Clause
# Compiles SOURCE (syntax only) and expects exactly its functions' errors, in
# order: one static_assert each, with a message that names what to pass,
# and no other error (one compile: LibTorch's headers are parsed once).
#   cmake -DCXX=... -DSOURCE=... -DINCLUDES="a;b;c" -P check_compile_errors.cmake
set(expected
  "pass the model as the program holds it"
  "pass the optimizer as the program holds it"
  "pass an optimizer as the program holds it")
set(flags -std=c++17 -fsyntax-only)
foreach(dir IN LISTS INCLUDES)
  list(APPEND flags -I${dir})
endforeach()
execute_process(COMMAND ${CXX} ${flags} ${SOURCE} RESULT_VARIABLE status ERROR_VARIABLE output OUTPUT_QUIET)
if(status EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled; expected ${expected}")
endif()
string(REPLACE ";" "," output "${output}")  # the messages' own ';' would split the list
string(REGEX MATCHALL "error: [^\n]*" errors "${output}")
list(LENGTH errors count)
list(LENGTH expected wanted)
if(NOT count EQUAL wanted)
  message(FATAL_ERROR "${count} errors, expected ${wanted} static_asserts (one per function):\n${output}")
endif()
foreach(i RANGE 1 ${wanted})
  math(EXPR index "${i} - 1")
  list(GET errors ${index} error)
  list(GET expected ${index} message)
  string(FIND "${error}" "static assertion failed" is_assert)
  string(FIND "${error}" "${message}" has_message)
  if(is_assert EQUAL -1 OR has_message EQUAL -1)
    message(FATAL_ERROR "error ${i} is not the static_assert naming what to pass (${message}):\n${error}")
  endif()
  message(STATUS "function ${i}: ${error}")
endforeach()
