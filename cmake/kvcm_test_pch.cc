// The translation unit that builds cmake/kvcm_test_pch.h's precompiled header.
