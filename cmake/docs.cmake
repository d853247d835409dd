# SPDX-License-Identifier: BSD-3-Clause
# amp's API reference: Doxygen over the public headers (amp/include/amp and
# opt_levels/include/amp, without their internal/ folders), configured from
# docs/Doxyfile.in. `cmake --build build --target docs` writes the HTML to
# build/docs/html/index.html and fails on any Doxygen warning - a public name
# without documentation among them. With the tests, ctest runs the same check
# and proves it fails on an undocumented name.
find_package(Doxygen QUIET)
if(NOT DOXYGEN_FOUND)
  message(STATUS "amp: Doxygen not found: no `docs` target and no API reference tests "
                 "(apt-get install doxygen)")
  return()
endif()

set(AMP_DOCS_OUTPUT_DIR ${PROJECT_BINARY_DIR}/docs)
configure_file(${PROJECT_SOURCE_DIR}/docs/Doxyfile.in ${PROJECT_BINARY_DIR}/Doxyfile @ONLY)

# WARN_AS_ERROR = FAIL_ON_WARNINGS: Doxygen reports every warning, then exits
# nonzero, which fails the target.
add_custom_target(docs
  COMMAND Doxygen::doxygen ${PROJECT_BINARY_DIR}/Doxyfile
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
  COMMENT "amp API reference: ${AMP_DOCS_OUTPUT_DIR}/html/index.html"
  VERBATIM)

if(AMP_BUILD_TESTS AND DOXYGEN_FOUND)
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  # Every public name of the real headers is documented: zero warnings.
  add_test(NAME api_reference_documents_every_public_name
           COMMAND Python3::Interpreter ${PROJECT_SOURCE_DIR}/tools/check_api_reference.py
                   --doxygen ${DOXYGEN_EXECUTABLE} --doxyfile ${PROJECT_BINARY_DIR}/Doxyfile)
  # The check fails on an undocumented declaration planted in a copy of the
  # headers, and names it.
  add_test(NAME api_reference_check_fails_on_an_undocumented_name
           COMMAND Python3::Interpreter ${PROJECT_SOURCE_DIR}/tools/check_api_reference.py
                   --doxygen ${DOXYGEN_EXECUTABLE} --doxyfile ${PROJECT_BINARY_DIR}/Doxyfile --plant)
endif()
