"""Offline CSV jobs (see the offline-jobs issue); the app exists so its queue and layout are in place."""
