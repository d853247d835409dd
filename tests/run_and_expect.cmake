# Runs COMMAND (its arguments separated by |) and fails unless its exit status is
# EXIT (a number, or "nonzero" for any failure), its output (stdout and
# stderr together) matches the regular expression MATCH, and - when given -
# does not match NOT_MATCH. ctest's own PASS_REGULAR_EXPRESSION ignores the
# exit status: a program that prints its summary and then crashes would pass.
string(REPLACE "|" ";" COMMAND "${COMMAND}")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(output "${out}${err}")
if(EXIT STREQUAL "nonzero")
  set(exit_ok NOT status EQUAL 0)
else()
  set(exit_ok status EQUAL ${EXIT})
endif()
if(NOT (${exit_ok}))
  message(FATAL_ERROR "exit status ${status}, expected ${EXIT}:\n${output}")
endif()
if(NOT output MATCHES "${MATCH}")
  message(FATAL_ERROR "output does not match '${MATCH}':\n${output}")
endif()
if(DEFINED NOT_MATCH AND output MATCHES "${NOT_MATCH}")
  message(FATAL_ERROR "output matches '${NOT_MATCH}':\n${output}")
endif()
