# Compiles each VARIANT of SOURCE (syntax only) and expects it to fail with a
# static_assert message that names what to pass, as the first error.
#   cmake -DCXX=... -DSOURCE=... -DINCLUDES="a;b;c" -P check_compile_errors.cmake
set(expected
  "1:pass the model as the program holds it"
  "2:pass the optimizer as the program holds it"
  "3:pass an optimizer as the program holds it")
set(flags -std=c++17 -fsyntax-only)
foreach(dir IN LISTS INCLUDES)
  list(APPEND flags -I${dir})
endforeach()
foreach(row IN LISTS expected)
  string(REGEX REPLACE ":.*" "" variant "${row}")
  string(REGEX REPLACE "^[0-9]+:" "" message "${row}")
  execute_process(COMMAND ${CXX} ${flags} -DVARIANT=${variant} ${SOURCE}
                  RESULT_VARIABLE status ERROR_VARIABLE output OUTPUT_QUIET)
  if(status EQUAL 0)
    message(FATAL_ERROR "variant ${variant} compiled; expected: ${message}")
  endif()
  string(REGEX MATCH "error: [^\n]*" first_error "${output}")
  string(FIND "${first_error}" "static assertion failed" is_assert)
  string(FIND "${first_error}" "${message}" has_message)
  if(is_assert EQUAL -1 OR has_message EQUAL -1)
    message(FATAL_ERROR "variant ${variant}: the first error is not the static_assert naming what "
                        "to pass (${message}):\n${first_error}")
  endif()
  message(STATUS "variant ${variant}: ${first_error}")
endforeach()
