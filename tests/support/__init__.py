"""Helpers shared by test suites: real servers started in-process, never fakes of kbmesh."""
